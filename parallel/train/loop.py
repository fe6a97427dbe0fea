"""The training loop shared by every model family.

``train(cfg, family)`` is collective: every rank of the job calls it with the same
config. It owns the grid, the readers, the hybrid-parallel model, the optimiser and
schedule, gradient accumulation, mixed precision, evaluation, the stop at the quality
target, checkpoints and reporting; the family supplies the network, fields, loss and
metric (``parallel.train.family.Family``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from mlperf_logging.mllog import constants as C

import parallel
from parallel.grid import Grid
from parallel.train import checkpoint
from parallel.train.config import JobConfig
from parallel.train.data import build_data
from parallel.train.evaluate import autocast, evaluate
from parallel.train.family import Family
from parallel.train.mlperf import log_submission, open_log
from parallel.train.optim import Schedule, build_optimizer
from parallel.train.report import (Reporter, format_summary, gather_per_rank, peak_memory_bytes,
                                   setup_logging, summarize)

log = logging.getLogger("parallel.train")


def train(cfg: JobConfig, family: Family) -> dict[str, Any]:
    """Run a training job from ``cfg``; returns the summary (on every rank)."""
    setup_logging(cfg.run, int(os.environ.get("RANK", os.environ.get("PMI_RANK", "0"))))
    grid = parallel.init(cfg.parallel.spatial, backend=cfg.parallel.backend, timeout_s=cfg.parallel.timeout_s)
    try:
        setup_logging(cfg.run, grid.rank)
        if grid.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", grid.world_size))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))
        return Trainer(cfg, family, grid).fit()
    finally:
        parallel.destroy()


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

        self.ml.start(C.STAGING_START)
        self.data = build_data(cfg, family, grid)
        self.ml.end(C.STAGING_STOP, staging_duration=self.data.staging_seconds)
        torch.manual_seed(cfg.train.seed)  # the same initial weights at every grid
        self.model = family.build_model(cfg.model, self.data.volume)
        self.pmodel = parallel.parallelize(self.model, grid, seed=cfg.train.seed)
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
        if self.resuming:
            self._resume()
        n_params = sum(p.numel() for p in self.model.parameters())
        log.info("%s: %.2fM parameters, volume %s, %d train / %d val samples, %d steps per epoch",
                 family.name, n_params / 1e6, self.data.volume, self.data.n_train, self.data.n_val,
                 self.steps_per_epoch)
        self.ml.event(C.TRAIN_SAMPLES, self.data.n_train)
        self.ml.event(C.EVAL_SAMPLES, self.data.n_val)

    # -- checkpoints -----------------------------------------------------------------
    def _resume(self) -> None:
        ckpt = checkpoint.load(self.ckpt_path, map_location=self.grid.device)
        self.pmodel.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        if self.scaler is not None and ckpt.get("scaler"):
            self.scaler.load_state_dict(ckpt["scaler"])
        self.step, self.epoch, self.samples = int(ckpt["step"]), int(ckpt["epoch"]), int(ckpt["samples"])
        self.best, self.reached_s = ckpt.get("best_metric"), ckpt.get("reached_seconds")
        self.run_s_before = float(ckpt.get("run_seconds", 0.0))
        self.io = ckpt.get("io", self.io).double().cpu()
        checkpoint.restore_rng(ckpt, self.grid, self.cfg.train.seed, self.model)
        log.info("resumed from %s at step %d (epoch %d)", self.ckpt_path, self.step, self.epoch)

    def save(self, run_s: float) -> None:
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "step": self.step, "epoch": self.epoch, "samples": self.samples,
            "sampler": {"epoch": self.epoch, "step": self.step - self.epoch * self.steps_per_epoch},
            "best_metric": self.best, "reached_seconds": self.reached_s, "run_seconds": run_s,
            "io": self.io.clone(),
            "meta": {"family": self.family.name, "spatial": list(self.grid.spatial),
                     "world_size": self.grid.world_size, "volume": list(self.data.volume)},
        }
        checkpoint.save(self.ckpt_path, self.grid, state, self.model)

    # -- one optimiser step ------------------------------------------------------------
    def train_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward, backward (accumulated over micro-batches) and update; the local loss."""
        cfg, fam = self.cfg, self.family
        if fam.augment is not None:
            gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + self.step)
            batch = fam.augment(batch, gen, self.grid, cfg)
        x, y = batch[fam.input_field], batch[fam.target_field]
        accum = cfg.train.accum_steps
        xs, ys = x.chunk(accum), y.chunk(accum)
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.grid.device)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            sync = contextlib.nullcontext() if i == accum - 1 else self.pmodel.no_sync()
            with sync:
                with autocast(cfg.train.precision, self.grid.device):
                    out = self.pmodel(xm)
                loss = fam.loss(out, ym, self.grid) / accum
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            total += loss.detach()
        lr = self.schedule.apply(self.optimizer, self.step)
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
        self.lr = lr
        return total

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
            "last_eval_step": last_eval_step,
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
