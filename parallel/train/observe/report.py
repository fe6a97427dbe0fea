"""What a run tells as it goes: the logger, metrics.jsonl, TensorBoard and the progress bar.

``Reporter`` observes the run (``parallel.train.observe.events``): every ``run.log_every``
steps (and at the last) a ``train`` row with the loss (averaged over data groups), the
learning rate, throughput, data waiting and the step-time breakdown; after every
evaluation an ``eval`` row. Rank 0 writes the files; per-rank numbers (peak memory, bytes
read, data wait) are gathered from every rank at each log step (one small all-gather) so
rank 0 can record them all. ``run.log_rank`` chooses which rank's logger speaks.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from parallel.grid import Grid
from parallel.job.config import RunConfig
from parallel.train.observe.events import Observer, RunClock, RunEnd
from parallel.train.observe.steptime import StepTimes
from parallel.train.observe.summary import PER_RANK, data_mean, per_rank

log = logging.getLogger("parallel.train")


class _BarAwareHandler(logging.StreamHandler):
    """Writes log lines above a live progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def setup_logging(cfg: RunConfig, rank: int) -> None:
    """One handler on the ``parallel`` logger; ranks other than the speaking one stay quiet."""
    speaker = cfg.log_rank
    if speaker == -2:
        speaker = int(os.environ.get("LOG_RANK", "0"))
    logger = logging.getLogger("parallel")
    for h in list(logger.handlers):
        logger.removeHandler(h)
    handler = _BarAwareHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.propagate = False
    speaks = speaker == -1 or speaker == rank
    logger.setLevel(getattr(logging, cfg.log_level.upper(), logging.INFO) if speaks else logging.WARNING)


class Reporter(Observer):
    """metrics.jsonl, TensorBoard and the progress bar (rank 0 writes; every rank takes part
    in a log step's collectives).

    ``total_steps``, ``steps_per_epoch``: the run's; ``start_step``: where this session
    starts (a resumed run rewrites the rows it repeats); ``lr()``: the current learning
    rate; ``metric_name``, ``target``: the family's metric and the run's target;
    ``global_batch``: samples per step; ``io_start``: the reading counters at the start;
    ``noise``: the run's gradient noise scale (``NoiseScale``), whose last step's figures
    each ``train`` row carries.
    """

    def __init__(self, cfg: RunConfig, grid: Grid, total_steps: int, steps_per_epoch: int, start_step: int,
                 resumed: bool, clock: RunClock, times: StepTimes, lr: Any, metric_name: str, target: float,
                 global_batch: int, io_start: tuple[float, float, float], noise: Any = None) -> None:
        self.cfg, self.grid, self.total, self.spe = cfg, grid, total_steps, steps_per_epoch
        self.clock, self.times, self.lr, self.metric_name, self.target = clock, times, lr, metric_name, target
        self.global_batch, self.io_start = global_batch, io_start
        self.noise = noise  # the gradient noise scale (parallel.train.observe.noisescale): its figures in each row
        self.best: float | None = None
        self._loss_sum, self._loss_n, self._n_log, self._t_log = torch.zeros((), device=grid.device), 0, 0, 0.0
        self.active = grid.rank == 0
        self.dir = Path(cfg.dir)
        self.writer = None
        self.bar = None
        if not self.active:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        _truncate_jsonl(self.metrics_path, start_step if resumed else -1)
        if not resumed:
            for old in (self.dir / "tb").glob("events.out.tfevents.*"):
                old.unlink()
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.dir / "tb"), purge_step=start_step + 1 if resumed else None)
        if cfg.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                            mininterval=1.0, file=sys.stderr, desc="train")

    # -- the run's events --------------------------------------------------------------
    def run_start(self, progress: Any) -> None:
        self.best = progress.best
        self._t_log = time.perf_counter()

    def step_end(self, progress: Any, loss: torch.Tensor, stats: Any) -> None:
        self._loss_sum += loss
        self._loss_n += 1
        self._n_log += 1
        step = progress.step
        if step % self.cfg.log_every and step != self.total:
            return
        mean_loss = data_mean(self._loss_sum / max(self._loss_n, 1), self.grid)
        dt = time.perf_counter() - self._t_log
        values = {"loss": mean_loss, "lr": self.lr(),
                  "samples_per_s": self._n_log * self.global_batch / max(dt, 1e-9),
                  "data_wait_s": float(stats.wait_seconds), "elapsed_s": self.clock.now(),
                  **self.times.log_values(), **(self.noise.log_values() if self.noise is not None else {})}
        self.record("train", step, step / self.spe, values, per_rank(progress.io, self.io_start, self.grid))
        self.progress(step, {"loss": mean_loss, "lr": self.lr(),
                             self.metric_name: self.best if self.best is not None else "-"})
        self._loss_sum, self._loss_n, self._n_log = torch.zeros((), device=self.grid.device), 0, 0
        self._t_log = time.perf_counter()

    def evaluated(self, progress: Any, epoch_num: int, values: dict[str, Any]) -> None:
        metric = values[f"val_{self.metric_name}"]
        self.best = progress.best
        self.record("eval", progress.step, progress.step / self.spe, values)
        self.progress(progress.step, {self.metric_name: metric, "best": progress.best})
        log.info("step %d epoch %d: val loss %.5f, %s %.5f (target %s)", progress.step, progress.epoch,
                 values["val_loss"], self.metric_name, metric, self.target)

    def run_end(self, end: RunEnd) -> None:
        self.close()

    # -- writing ---------------------------------------------------------------------------
    def record(self, kind: str, step: int, epoch: float, values: dict[str, Any],
               per_rank: torch.Tensor | None = None) -> None:
        """One metrics.jsonl object and its TensorBoard scalars."""
        if not self.active:
            return
        row: dict[str, Any] = {"kind": kind, "step": step, "epoch": round(epoch, 4), **values}
        if per_rank is not None:
            for j, name in enumerate(PER_RANK):
                row[name] = [float(v) for v in per_rank[:, j].tolist()]
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(f"{kind}/{key}", value, step)
            if per_rank is not None:
                for j, name in enumerate(PER_RANK):
                    for r, v in enumerate(per_rank[:, j].tolist()):
                        self.writer.add_scalar(f"rank/{name}/{r}", v, step)
            self.writer.flush()

    def progress(self, step: int, postfix: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in postfix.items()},
                                 refresh=False)
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()


def _truncate_jsonl(path: Path, keep_until_step: int) -> None:
    """Keep only lines at or before ``keep_until_step`` (-1: drop all): a resumed run
    rewrites the steps it repeats instead of logging them twice."""
    if not path.exists():
        return
    kept = []
    if keep_until_step >= 0:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    if json.loads(line).get("step", 0) <= keep_until_step:
                        kept.append(line)
                except json.JSONDecodeError:
                    break  # a line cut by a kill: everything after it is gone too
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)
