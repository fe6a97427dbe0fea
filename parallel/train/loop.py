"""The training loop shared by every model family.

``train(cfg, family)`` is collective: every rank of the job calls it with the same
config. It owns the grid, the readers, the hybrid-parallel model, the optimiser and
schedule, gradient accumulation, mixed precision, evaluation, the stop at the quality
target, checkpoints and reporting; the family supplies the network, fields, loss and
metric (``parallel.train.family.Family``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from enum import Enum
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from mlperf_logging.mllog import constants as C

import parallel
from parallel.data.reader import SampleReadError
from parallel.grid import Grid
from parallel.launch import env_rank, store_address
from parallel.partition import SplitError
from parallel.train import checkpoint, preflight
from parallel.train.config import JobConfig
from parallel.train.data import FINITE_KEY, build_data
from parallel.train.evaluate import autocast, evaluate
from parallel.train.family import Family
from parallel.train.mlperf import log_submission, open_log
from parallel.train.optim import Schedule, build_optimizer
from parallel.train.report import (Reporter, format_summary, gather_per_rank, peak_memory_bytes,
                                   setup_logging, summarize)
from parallel.watchdog import Watchdog

log = logging.getLogger("parallel.train")

# Failures reported as one line (the message says what and where); anything else is
# logged with its traceback, since it is probably a bug.
CLEAN_ERRORS = (preflight.InputError, checkpoint.CheckpointError, SampleReadError, SplitError,
                FileNotFoundError, PermissionError)


class NonFiniteError(RuntimeError):
    """The loss or the gradients became NaN or inf (the same decision on every rank)."""

    collective = True


def train(cfg: JobConfig, family: Family) -> dict[str, Any]:
    """Run a training job from ``cfg``; returns the summary (on every rank).

    Any failure ends the process with a non-zero status (2: bad input or config, 1:
    anything else) after one clear message; with several ranks the watchdog makes every
    rank stop, naming the rank that failed (``docs/failures.md``).
    """
    setup_logging(cfg.run, env_rank())
    auto = str(cfg.parallel.spatial) == "auto"
    try:
        if auto:  # validated with a placeholder; rank 0 decides once the process group runs
            cfg.parallel.spatial = [1, 1, 1]
        preflight.validate_config(cfg)
    except preflight.ConfigError as err:
        log.error("bad config: %s", err)
        raise SystemExit(2) from None
    try:
        spatial: Any = cfg.parallel.spatial
        if auto:
            from parallel.train.autosplit import auto_spatial

            spatial = lambda: auto_spatial(cfg, family)  # noqa: E731
        grid = parallel.init(spatial, backend=cfg.parallel.backend, timeout_s=cfg.parallel.timeout_s, tf32=cfg.train.tf32)
        if auto:
            cfg.parallel.spatial = list(grid.spatial)
            log.info("parallel.spatial=auto chose %s for %d ranks (parallel.plan)", "x".join(map(str, grid.spatial)),
                     grid.world_size)
    except ValueError as err:  # the grid does not fit the world size, or auto found no split
        log.error("bad config: parallel.spatial=%s: %s", "auto" if auto else list(cfg.parallel.spatial), err)
        parallel.destroy()
        raise SystemExit(2) from None
    watchdog = None
    try:
        setup_logging(cfg.run, grid.rank)
        watchdog = _start_watchdog(cfg, grid)
        if grid.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", grid.world_size))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))
        summary = Trainer(cfg, family, grid).fit()
    except BaseException as exc:  # noqa: BLE001 - every failure ends the job, loudly
        _fail(exc, grid, watchdog)
    if watchdog is not None:
        watchdog.stop()  # before the barrier: nobody watches a peer that has left
    if grid.world_size > 1:
        dist.barrier(group=grid.world_group)
    parallel.destroy()
    return summary


def _start_watchdog(cfg: JobConfig, grid: Grid) -> Watchdog | None:
    """The watchdog of a multi-rank job; rank 0 writes ``run.dir/ranks.json`` (host, pid)."""
    address = store_address()
    if grid.world_size == 1 or address is None:
        return None
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    wd = Watchdog(grid.rank, grid.world_size, address, cfg.parallel.timeout_s, cfg.parallel.heartbeat_s,
                  launcher=grid.launcher, namespace=f"spatialcnn/watchdog/{attempt}").start()
    if grid.rank == 0:
        path = Path(cfg.run.dir) / "ranks.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(wd.table(), indent=1), encoding="utf-8")
        log.info("watchdog on: a failed rank stops the job within about %gs (dead peer on this host, or a "
                 "reported error) or %gs (silent peer); ranks' hosts and pids in %s",
                 cfg.parallel.heartbeat_s, cfg.parallel.timeout_s, path)
    return wd


def _fail(exc: BaseException, grid: Grid, watchdog: Watchdog | None) -> NoReturn:
    """Report ``exc`` (once, cleanly) and end this process, or with the watchdog, the job."""
    if isinstance(exc, SystemExit) and not exc.code:
        exc = RuntimeError("exited early (SystemExit)")
    user = isinstance(exc, CLEAN_ERRORS) or isinstance(exc, NonFiniteError)
    code = 2 if isinstance(exc, preflight.InputError) else 1
    collective = bool(getattr(exc, "collective", False))
    if watchdog is None:
        if user:
            log.error("%s", exc)
        else:
            log.error("failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
        parallel.destroy()
        raise SystemExit(code) from None
    if not user and not watchdog.blames_peer(exc):
        log.error("rank %d: %s: %s", grid.rank, type(exc).__name__, exc, exc_info=exc)
    watchdog.fail(exc, own_error=user, code=code, collective=collective)


class Trainer:
    """One job's state; ``fit`` runs it to the end (epochs, max_steps or target)."""

    def __init__(self, cfg: JobConfig, family: Family, grid: Grid) -> None:
        self.cfg, self.family, self.grid = cfg, family, grid
        run_dir = Path(cfg.run.dir)
        self.ckpt_path = checkpoint.checkpoint_path(run_dir)
        self.resuming = cfg.train.resume and self.ckpt_path.is_file()
        if grid.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            if not self.resuming:
                for name in ("mlperf.log", "summary.json"):
                    (run_dir / name).unlink(missing_ok=True)
        if grid.world_size > 1:
            dist.barrier(group=grid.world_group)
        self.ml = open_log(cfg, grid, family.name)
        log_submission(self.ml, cfg, grid, family.name, n_nodes=_node_count(grid))

        volume = preflight.check_data(cfg, family, grid)  # bad files stop the job here, on every rank
        channels = preflight.sample_spec(family)[family.input_field].channels or 1
        preflight.check_model(family, cfg.model, volume, channels, grid)
        self.ml.start(C.STAGING_START)
        self.data = build_data(cfg, family, grid)
        self.ml.end(C.STAGING_STOP, staging_duration=self.data.staging_seconds)
        torch.manual_seed(cfg.train.seed)  # the same initial weights at every grid
        self.model = family.build_model(cfg.model, self.data.volume)
        self.pmodel = parallel.parallelize(self.model, grid, seed=cfg.train.seed,
                                           overlap_halo=cfg.parallel.overlap_halo,
                                           recompute=cfg.train.activation_checkpointing)
        torch.manual_seed(cfg.train.seed + 7919 * (grid.rank + 1))  # per-rank dropout stream
        self.optimizer = build_optimizer(self.pmodel.parameters(), cfg.optim)
        self.steps_per_epoch = len(self.data.train)
        self.schedule = Schedule(cfg.sched, cfg.optim, cfg.train.global_batch_size,
                                 self.steps_per_epoch, cfg.train.epochs)
        self.scaler = torch.amp.GradScaler("cuda") if cfg.train.precision == "fp16" else None
        self.target = family.target if cfg.train.target is None else cfg.train.target
        self.step, self.epoch, self.samples = 0, 0, 0
        self.best: float | None = None
        self.reached_s: float | None = None
        self.run_s_before = 0.0
        self.io = torch.zeros(3, dtype=torch.float64)  # bytes read, data wait, samples read
        self.skipped_samples = 0  # non-finite inputs left out (this data group)
        self.skipped_steps = 0  # updates dropped for non-finite gradients
        self.bad_in_a_row = 0
        self.saved_step: int | None = None
        if self.resuming:
            self._resume()
        n_params = sum(p.numel() for p in self.model.parameters())
        log.info("%s: %.2fM parameters, volume %s, %d train / %d val samples, %d steps per epoch",
                 family.name, n_params / 1e6, self.data.volume, self.data.n_train, self.data.n_val,
                 self.steps_per_epoch)
        self.ml.event(C.TRAIN_SAMPLES, self.data.n_train)
        self.ml.event(C.EVAL_SAMPLES, self.data.n_val)

    # -- checkpoints -----------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        """What a checkpoint must match to resume this run."""
        return {"family": self.family.name, "volume": list(self.data.volume), "model": _plain_config(self.cfg.model)}

    def _resume(self) -> None:
        ckpt, path = checkpoint.load_latest(self.ckpt_path, map_location=self.grid.device)
        checkpoint.check_matches(ckpt, self._meta(), path)
        try:
            self.pmodel.load_state_dict(ckpt["model"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
        except (RuntimeError, KeyError, ValueError) as err:
            raise checkpoint.CheckpointError(f"checkpoint {path} does not fit this model: {err}") from err
        if self.scaler is not None and ckpt.get("scaler"):
            self.scaler.load_state_dict(ckpt["scaler"])
        self.step, self.epoch, self.samples = int(ckpt["step"]), int(ckpt["epoch"]), int(ckpt["samples"])
        self.best, self.reached_s = ckpt.get("best_metric"), ckpt.get("reached_seconds")
        self.run_s_before = float(ckpt.get("run_seconds", 0.0))
        self.io = ckpt.get("io", self.io).double().cpu()
        self.skipped_samples = int(ckpt.get("skipped_samples", 0))
        self.skipped_steps = int(ckpt.get("skipped_steps", 0))
        self.saved_step = self.step
        checkpoint.restore_rng(ckpt, self.grid, self.cfg.train.seed, self.model)
        log.info("resumed from %s at step %d (epoch %d)", path, self.step, self.epoch)

    def save(self, run_s: float) -> None:
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "step": self.step, "epoch": self.epoch, "samples": self.samples,
            "sampler": {"epoch": self.epoch, "step": self.step - self.epoch * self.steps_per_epoch},
            "best_metric": self.best, "reached_seconds": self.reached_s, "run_seconds": run_s,
            "io": self.io.clone(),
            "skipped_samples": self.skipped_samples, "skipped_steps": self.skipped_steps,
            "meta": {**self._meta(), "spatial": list(self.grid.spatial), "world_size": self.grid.world_size},
        }
        checkpoint.save(self.ckpt_path, self.grid, state, self.model, keep=self.cfg.run.keep_checkpoints)
        self.saved_step = self.step

    # -- one optimiser step ------------------------------------------------------------
    def train_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward, backward (accumulated over micro-batches) and update; the local loss."""
        cfg, fam = self.cfg, self.family
        if fam.augment is not None:
            gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + self.step)
            batch = fam.augment(batch, gen, self.grid, cfg)
        x, y = batch[fam.input_field], batch[fam.target_field]
        if FINITE_KEY in batch:
            x, y = self._drop_nonfinite(x, y, batch[FINITE_KEY])
        accum = cfg.train.accum_steps
        # tensor_split: always `accum` pieces (some may be empty after skipped samples),
        # so every rank runs the same collectives
        xs, ys = torch.tensor_split(x, accum), torch.tensor_split(y, accum)
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.grid.device)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            sync = contextlib.nullcontext() if i == accum - 1 else self.pmodel.no_sync()
            with sync:
                with autocast(cfg.train.precision, self.grid.device):
                    out = self.pmodel(xm)
                if len(ym):
                    loss = fam.loss(out, ym, self.grid) / accum
                else:  # nothing left to learn from: zero gradients, same collectives
                    loss = _zero_loss(out)
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            total += loss.detach()
        lr = self.schedule.apply(self.optimizer, self.step)
        self.lr = lr
        if self.scaler is None and not self._finite_step(total):
            self.optimizer.zero_grad(set_to_none=True)
            return torch.zeros((), device=self.grid.device)
        if self.scaler is not None:
            if cfg.train.grad_clip > 0:
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.pmodel.parameters(), cfg.train.grad_clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            if cfg.train.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.pmodel.parameters(), cfg.train.grad_clip)
            self.optimizer.step()
        return total

    def _drop_nonfinite(self, x: torch.Tensor, y: torch.Tensor, flags: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Leave out samples whose block is non-finite on any rank of the spatial group."""
        good = flags.to(device=self.grid.device, dtype=torch.int32)
        if self.grid.spatial_size > 1:
            dist.all_reduce(good, op=dist.ReduceOp.MIN, group=self.grid.spatial_group)
        keep = good.bool()
        n_bad = int((~keep).sum())
        if n_bad:
            self.skipped_samples += n_bad
            log.warning("step %d: %d sample(s) with non-finite input left out (data.nonfinite=skip); "
                        "%d so far in this data group", self.step + 1, n_bad, self.skipped_samples)
            x, y = x[keep], y[keep]
        return x, y

    def _finite_step(self, loss: torch.Tensor) -> bool:
        """Whether the step's gradients (identical on every rank after the sync) are finite.

        Non-finite: raise (``train.nonfinite=fail``) or drop the update and count it.
        """
        grads = [p.grad for p in self.pmodel.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if bool(torch.isfinite(norm)):
            self.bad_in_a_row = 0
            if not bool(torch.isfinite(loss)):
                log.warning("step %d: the loss is %s on this rank but the gradients are finite",
                            self.step + 1, float(loss))
            return True
        bad = next((n for n, p in self.model.named_parameters()
                    if p.grad is not None and not bool(torch.isfinite(p.grad).all())), "?")
        what = (f"step {self.step + 1}: non-finite gradients (norm {float(norm)}, first in '{bad}'; "
                f"loss {float(loss):.6g} on this data group)")
        last = (f"the last good checkpoint is {self.ckpt_path} (step {self.saved_step})"
                if self.saved_step is not None else "no checkpoint was written yet")
        if str(self.cfg.train.nonfinite) == "fail":
            raise NonFiniteError(f"{what}; stopping (train.nonfinite=fail): {last}. Resume with a lower "
                                 "optim.lr or train.grad_clip, or set train.nonfinite=skip")
        self.bad_in_a_row += 1
        if self.bad_in_a_row > self.cfg.train.max_skipped_steps:
            raise NonFiniteError(f"{what}; {self.bad_in_a_row} steps in a row were non-finite "
                                 f"(train.max_skipped_steps={self.cfg.train.max_skipped_steps}): {last}")
        self.skipped_steps += 1
        log.warning("%s: update skipped (train.nonfinite=skip; %d skipped so far)", what, self.skipped_steps)
        return False

    # -- the run -----------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        cfg, grid, fam = self.cfg, self.grid, self.family
        spe = self.steps_per_epoch
        total = cfg.train.epochs * spe
        if cfg.train.max_steps:
            total = min(total, cfg.train.max_steps)
        rep = Reporter(cfg.run, grid, total, self.step, self.resuming)
        self.ml.end(C.INIT_STOP)
        self.ml.start(C.RUN_START)
        t_run = time.perf_counter() - self.run_s_before
        train_s = 0.0
        status, last_eval_step, self.lr = "aborted", -1, self.schedule.lr(self.step)
        metric_key = f"val_{fam.metric_name}"
        loss_sum, loss_n, t_log, n_log = torch.zeros((), device=grid.device), 0, time.perf_counter(), 0
        done = self.step >= total or (self.best is not None and fam.reached(self.best, self.target)
                                       and cfg.train.stop_at_target)
        while not done:
            in_epoch = self.step - self.epoch * spe
            self.data.train.set_epoch(self.epoch, in_epoch)
            self.ml.start(C.EPOCH_START, epoch_num=self.epoch + 1)
            t_epoch = time.perf_counter()
            for batch, stats in self.data.train:
                loss_sum += self.train_step(batch)
                loss_n += 1
                n_log += 1
                self.step += 1
                self.samples += cfg.train.global_batch_size
                self.io += torch.tensor([stats.bytes_read, stats.wait_seconds, stats.samples], dtype=torch.float64)
                if self.step % cfg.run.log_every == 0 or self.step == total:
                    mean_loss = _data_mean(loss_sum / max(loss_n, 1), grid)
                    dt = time.perf_counter() - t_log
                    values = {"loss": mean_loss, "lr": self.lr,
                              "samples_per_s": n_log * cfg.train.global_batch_size / max(dt, 1e-9),
                              "data_wait_s": float(stats.wait_seconds),
                              "elapsed_s": time.perf_counter() - t_run}
                    rep.record("train", self.step, self.step / spe, values, self._per_rank())
                    rep.progress(self.step, {"loss": mean_loss, "lr": self.lr,
                                             fam.metric_name: self.best if self.best is not None else "-"})
                    loss_sum, loss_n, t_log, n_log = torch.zeros((), device=grid.device), 0, time.perf_counter(), 0
                if cfg.run.checkpoint_every and self.step % cfg.run.checkpoint_every == 0:
                    self.save(time.perf_counter() - t_run)
                if self.step >= total:
                    break
            train_s += time.perf_counter() - t_epoch
            self.ml.end(C.EPOCH_STOP, epoch_num=self.epoch + 1)
            finished_epoch = self.step % spe == 0
            if finished_epoch:
                self.epoch += 1
            want_eval = (finished_epoch and cfg.train.eval_every and self.epoch % cfg.train.eval_every == 0) \
                or (self.step >= total and cfg.train.eval_at_end)
            if want_eval:
                values = self._evaluate(rep, t_run)
                last_eval_step = self.step
                if fam.reached(values[metric_key], self.target) and cfg.train.stop_at_target:
                    status, done = "success", True
            if self.step >= total:
                done = True
            if finished_epoch or done:
                self.save(time.perf_counter() - t_run)
        if status != "success" and self.best is not None and fam.reached(self.best, self.target):
            status = "success"
        run_s = time.perf_counter() - t_run
        self.ml.end(C.RUN_STOP, status=status)
        self.ml.close()
        per_rank = self._per_rank()
        summary = summarize(grid, {
            "status": status, "steps": self.step, "epochs": self.step / spe, "metric": metric_key,
            "best_metric": self.best, "target": self.target, "time_to_target_s": self.reached_s,
            "run_seconds": run_s, "train_seconds": train_s,
            "samples_per_s": (self.step * cfg.train.global_batch_size / train_s) if train_s > 0 else 0.0,
            "last_eval_step": last_eval_step, "skipped_steps": self.skipped_steps,
            "skipped_samples": int(round(_data_mean(torch.tensor(float(self.skipped_samples), device=grid.device), grid)
                                         * grid.data_size)),
        }, per_rank, self.samples)
        rep.close()
        if grid.rank == 0:
            path = Path(cfg.run.dir) / "summary.json"
            path.write_text(json.dumps(summary, indent=1), encoding="utf-8")
        log.info("summary (%s):\n%s", Path(cfg.run.dir) / "summary.json", format_summary(summary))
        return summary

    def _evaluate(self, rep: Reporter, t_run: float) -> dict[str, Any]:
        fam = self.family
        epoch_num = self.epoch if self.step % self.steps_per_epoch == 0 else self.epoch + 1
        self.ml.start(C.EVAL_START, epoch_num=epoch_num)
        values = evaluate(self.pmodel, self.data.val, fam, self.grid, self.cfg.train.precision, self.epoch)
        metric = values[f"val_{fam.metric_name}"]
        self.ml.event(fam.mlperf_eval_key, metric, epoch_num=epoch_num)
        self.ml.end(C.EVAL_STOP, epoch_num=epoch_num)
        if self.best is None or (metric < self.best if fam.goal == "min" else metric > self.best):
            self.best = metric
        if self.reached_s is None and fam.reached(metric, self.target):
            self.reached_s = time.perf_counter() - t_run
        values["elapsed_s"] = time.perf_counter() - t_run
        rep.record("eval", self.step, self.step / self.steps_per_epoch, values)
        rep.progress(self.step, {fam.metric_name: metric, "best": self.best})
        log.info("step %d epoch %d: val loss %.5f, %s %.5f (target %s)", self.step, self.epoch,
                 values["val_loss"], fam.metric_name, metric, self.target)
        return values

    def _per_rank(self) -> torch.Tensor:
        io = self.io.tolist()
        return gather_per_rank([peak_memory_bytes(self.grid.device), io[0], io[1], io[2]], self.grid)


def _zero_loss(out: Any) -> torch.Tensor:
    """A loss of 0 that still reaches every parameter the output came from."""
    if isinstance(out, torch.Tensor):
        return out.sum() * 0.0
    if isinstance(out, (tuple, list)):
        return sum((_zero_loss(o) for o in out), torch.zeros(()))
    if isinstance(out, dict):
        return sum((_zero_loss(o) for o in out.values()), torch.zeros(()))
    return torch.zeros(())


def _plain_config(cfg: Any) -> Any:
    """A config dataclass as plain dicts, lists and scalars (loadable with weights_only)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: _plain_config(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, Enum):
        return str(cfg.value)
    if isinstance(cfg, (list, tuple)):
        return [_plain_config(v) for v in cfg]
    if isinstance(cfg, dict):
        return {str(k): _plain_config(v) for k, v in cfg.items()}
    return cfg


def _data_mean(x: torch.Tensor, grid: Grid) -> float:
    """The mean over data groups of a value replicated within each spatial group."""
    x = x.detach().clone().double()
    if grid.data_size > 1:
        dist.all_reduce(x, group=grid.data_group)
        x /= grid.data_size
    return float(x)


def _node_count(grid: Grid) -> int:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("MPI_LOCALNRANKS", grid.world_size)))
    return max(1, math.ceil(grid.world_size / max(local, 1)))
