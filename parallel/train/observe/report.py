"""What a run tells: the logger, metrics.jsonl, TensorBoard, the progress bar, the summary.

Rank 0 writes the files; per-rank numbers (peak memory, bytes read, data wait) are
gathered from every rank at each log step (one small all-gather) so rank 0 can record
them all. ``run.log_rank`` chooses which rank's logger speaks.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
from parallel import comm

from parallel.grid import Grid
from parallel.runtime.memory import peak_rss_bytes
from parallel.train.checks.budget import summary_fields as memory_budget_fields
from parallel.job.config import RunConfig
from parallel.train.observe.steptime import format_line as step_time_line

log = logging.getLogger("parallel.train")

PER_RANK = ("peak_memory_bytes", "bytes_read", "data_wait_seconds", "samples_read", "peak_reserved_bytes")


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


def peak_memory_bytes(device: torch.device) -> int:
    """Peak device memory (CUDA) or peak resident set size of this process (CPU: Linux's
    VmHWM; ``ru_maxrss`` would report the launcher's peak where that is larger, as it is
    inherited across exec)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


def peak_reserved_bytes(device: torch.device) -> int:
    """Peak memory the process held, beside the live tensors' peak: CUDA's caching
    allocator reserves more than it hands out (fragmentation, cached blocks), and that is
    what an out-of-memory error counts; on the CPU the resident peak (as above)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    return peak_memory_bytes(device)


def reset_peak_memory(device: torch.device) -> bool:
    """Start the peaks afresh (after the start-up checks: the float64 verification's copies
    of the model are not training's memory). CUDA: the allocator's peak statistics; CPU:
    VmHWM back to the resident size (``5`` into ``/proc/self/clear_refs``). False where
    the system does not allow it (the peak then includes the start-up)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def gather_per_rank(values: list[float], grid: Grid) -> torch.Tensor:
    """(world, len(values)) float64 of every rank's numbers, on every rank."""
    mine = torch.tensor(values, dtype=torch.float64, device=grid.device)
    if grid.world_size == 1:
        return mine[None].cpu()
    return torch.stack(comm.all_gather(mine, grid.world_group, caller="report.gather_per_rank")).cpu()


class Reporter:
    """metrics.jsonl, TensorBoard and the progress bar (rank 0); a no-op elsewhere."""

    def __init__(self, cfg: RunConfig, grid: Grid, total_steps: int, start_step: int, resumed: bool) -> None:
        self.cfg = cfg
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


def summarize(grid: Grid, values: dict[str, Any], per_rank: torch.Tensor, samples_trained: int) -> dict[str, Any]:
    """The final summary: time to target, throughput, per-rank memory and bytes per sample."""
    out = dict(values)
    out["peak_memory_bytes_per_rank"] = [int(v) for v in per_rank[:, 0].tolist()]
    if per_rank.shape[1] > 4:
        out["peak_reserved_bytes_per_rank"] = [int(v) for v in per_rank[:, 4].tolist()]
    read = per_rank[:, 1]
    samples = per_rank[:, 3].clamp(min=1)
    out["bytes_read_per_rank"] = [int(v) for v in read.tolist()]
    out["bytes_read_per_rank_per_sample"] = [float(v) for v in (read / samples).tolist()]
    out["data_wait_seconds_per_rank"] = [round(float(v), 3) for v in per_rank[:, 2].tolist()]
    out["grid"] = {"world": grid.world_size, "data": grid.data_size, "spatial": list(grid.spatial)}
    out["samples_trained"] = samples_trained
    out.update(memory_budget_fields(out["peak_memory_bytes_per_rank"]))  # budget and prediction beside the peaks
    return out


def conv_paths(model: Any) -> dict[str, int]:
    """How many split convolutions took each path at their last forward (``parallel.conv_path``:
    ``shell`` or ``window``; ``auto`` resolves to one of them per layer)."""
    out: dict[str, int] = {}
    for m in model.modules():
        path = getattr(m, "path_chosen", None)
        if path is not None:
            out[path] = out.get(path, 0) + 1
    return out


def format_summary(s: dict[str, Any]) -> str:
    """A few human lines of the summary."""
    mib = [f"{v / 2**20:.0f}" for v in s["peak_memory_bytes_per_rank"]]
    per_sample = [f"{v / 2**10:.1f}" for v in s["bytes_read_per_rank_per_sample"]]
    ttt = s.get("time_to_target_s")
    why = {"success": "reached the target", "max_steps": "stopped at train.max_steps",
           "completed": "completed train.epochs without reaching the target"}.get(s["status"], s["status"])
    sess = s.get("session") or {}
    resumed = f", resumed at step {sess['first_step']}" if sess.get("first_step") else ""
    lines = [
        f"status: {s['status']} ({why}) after {s['steps']} steps, {s['epochs']:.2f} epochs "
        f"(grid data {s['grid']['data']} x spatial {s['grid']['spatial']}){resumed}",
        f"{s['metric']}: {s.get('best_metric')} (target {s['target']})"
        + (f", time to target {ttt:.1f} s" if ttt is not None else ", target not reached"),
        f"this session: {sess.get('steps', s['steps'])} steps, {sess.get('samples', 0)} samples; train throughput "
        f"{s['samples_per_s']:.2f} samples/s, run time {s['run_seconds']:.1f} s",
        f"peak memory per rank (MiB): {', '.join(mib)} allocated"
        + (f"; {', '.join(f'{v / 2**20:.0f}' for v in s['peak_reserved_bytes_per_rank'])} reserved"
           if s.get("peak_reserved_bytes_per_rank") else ""),
        f"bytes read per rank per sample (KiB): {', '.join(per_sample)}",
    ]
    breakdown = step_time_line(s)
    if breakdown:
        lines.append(breakdown)
    if s.get("run_dir"):
        lines.append(f"run.dir: {s['run_dir']}")
    return "\n".join(lines)
