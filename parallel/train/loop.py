"""The trainer's run: epochs of steps, evaluation, the stop at the quality target,
checkpoints and reporting.

``Trainer(cfg, family, grid, checks).fit()`` runs on every rank of a job that
``parallel.train.lifecycle.train`` started. The trainer owns the readers, the
hybrid-parallel model, the optimiser and schedule, mixed precision and the
``TrainState``; one step is a ``TrainStep``; the family supplies the network, fields,
loss and metric (``parallel.job.family.Family``).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch
from parallel import comm
from mlperf_logging.mllog import constants as C

import parallel
from parallel.split import layout
from parallel.grid import Grid
from parallel.infer import evaluation_due
from parallel.model.random_draws import stream_seed
from parallel.job import checkpoint
from parallel.train.persist import rng, writer
from parallel.train import elastic, stopsignal
from parallel.train.checks import InputError, JobChecks
from parallel.model.compiled import compile_model
from parallel.job.config import JobConfig
from parallel.train.data import build_data, fixed_shapes
from parallel.train.evaluate import evaluate
from parallel.job.family import Family
from parallel.train.observe.mlperf import log_submission, open_log
from parallel.train.optim import Schedule, build_optimizer
from parallel.train.observe.report import (Reporter, conv_paths, format_summary, gather_per_rank, peak_memory_bytes,
                                   peak_reserved_bytes, reset_peak_memory, summarize)
from parallel.train.scaler import LossScaler
from parallel.train.observe.profile import StepProfiler
from parallel.train.persist.state import TrainState, plain_config
from parallel.train.step import NonFiniteGuard, TrainStep
from parallel.train.observe.steptime import StepTimes
from parallel.train.observe.steptime import summary_fields as step_time_fields

log = logging.getLogger("parallel.train")


class Trainer:
    """One job's state; ``fit`` runs it to the end (epochs, max_steps or target)."""

    def __init__(self, cfg: JobConfig, family: Family, grid: Grid,
                 checks: JobChecks | None = None, on_start: Callable[[], None] | None = None,
                 regrid: elastic.Regrid | None = None) -> None:
        """``checks``: the job's checks, validated (``lifecycle.train``; None: validated here);
        the trainer runs the rest of the pass: samples -> fit here, verify once the model is
        built. ``on_start``: called (every rank) once the checks passed and a resume is
        known to proceed, before any file of the run is written, moved or cut. ``regrid``:
        this session's grid in an elastic run (``parallel.train.elastic``)."""
        self.cfg, self.family, self.grid = cfg, family, grid
        self.stop = stopsignal.arm(cfg.run.stop_signal, grid)  # first: the signal may come during start-up
        run_dir = Path(cfg.run.dir)
        self.ckpt_path = checkpoint.checkpoint_path(run_dir)
        self.resuming = cfg.train.resume and self.ckpt_path.is_file()
        if checks is None:
            checks = JobChecks(cfg, family)
            checks.validate()
        # bad files stop the job here, on every rank; the facts are read once and handed on
        facts = checks.samples(grid)
        volume = checks.fit(grid)
        meta = {"family": family.name, "volume": list(volume), "model": plain_config(cfg.model)}
        self._ckpt = None
        if self.resuming:  # a checkpoint of another model is refused before any log is moved or cut
            self._ckpt = checkpoint.load_latest(self.ckpt_path, map_location=grid.device)
            try:
                checkpoint.check_matches(self._ckpt[0], meta, self._ckpt[1])
            except checkpoint.CheckpointError as err:  # a config that does not fit: exit 2, like other config errors
                raise InputError(str(err)) from None
        if on_start is not None:
            on_start()
        if grid.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
        comm.barrier(grid.world_group, caller="Trainer: run.dir ready")
        # -- elastic restart: the run's MLPerf log goes on in the same file (parallel.train.elastic) --
        if elastic.continues_log(cfg, self.resuming):
            self.ml: Any = elastic.open_continued_log(cfg, grid, regrid, lambda: self.progress.step)
        else:
            self.ml = open_log(cfg, grid, family.name)
        log_submission(self.ml, cfg, grid, family.name, n_nodes=grid.node_count)
        self.ml.start(C.STAGING_START)
        self.data = build_data(cfg, family, grid, facts)
        self.ml.end(C.STAGING_STOP, staging_duration=self.data.staging_seconds)
        torch.manual_seed(cfg.train.seed)  # the same initial weights at every grid
        self.model = family.build_model(cfg.model, self.data.volume)
        if cfg.train.precision == "fp64":  # weights (and, in the step, samples) in float64
            self.model.double()
        # Flatten+Linear weights sharded by block, except under K-FAC, which preconditions the
        # whole weight (a sharded one would take the plain update, unlike the serial run).
        # parallel.verify: the converted model against a copy of the serial one, before the first step
        cl = cfg.parallel.channels_last  # auto: where NDHWC was measured faster (parallel.split.layout.preferred)
        self.channels_last = layout.preferred(grid.device, str(cfg.train.precision)) if cl == "auto" else bool(cl)
        self.pmodel = checks.verify(self.model, lambda: parallel.parallelize(
            self.model, grid, seed=cfg.train.seed, overlap_halo=cfg.parallel.overlap_halo,
            recompute=cfg.train.activation_checkpointing, input_shape=(facts.channels, *self.data.volume),
            shard_linear=str(cfg.optim.name) != "kfac", channels_last=self.channels_last,
            conv_path=str(cfg.parallel.conv_path)), grid)
        compile_model(self.pmodel, cfg.train.compile)  # train.compile: after the eager model's verification
        reset_peak_memory(grid.device)  # the summary's peaks are training's, not the float64 verification's
        # one global stream per data group, alike on the ranks of a spatial group (the serial run's for
        # data group 0): random draws in a network's forward (stochastic depth) equal the serial run's
        torch.manual_seed(stream_seed(cfg.train.seed, grid.data_rank))
        scaler = LossScaler() if cfg.train.precision == "fp16" else None  # its decisions from the global norm
        # weight decay only where the family's reference applies it (one group when there is none to apply)
        chosen = family.decayed is not None and not cfg.optim.decay_all and cfg.optim.weight_decay > 0
        decayed = family.decayed(self.model) if chosen else None  # type: ignore[misc]
        # K-FAC hooks into the model and takes the scale of its captured gradients out
        self.optimizer = build_optimizer(self.pmodel.named_parameters() if decayed is not None
                                         else self.pmodel.parameters(), cfg.optim, decayed=decayed,
                                         model=self.pmodel, grid=grid, grad_scaler=scaler)
        self.steps_per_epoch = len(self.data.train)
        self.schedule = Schedule(cfg.sched, cfg.optim, cfg.train.global_batch_size,
                                 self.steps_per_epoch, cfg.train.epochs)
        self.target = family.target if cfg.train.target is None else cfg.train.target
        self.state = TrainState(self.model, self.optimizer, scaler, self.steps_per_epoch, meta)
        self.progress = self.state.progress
        self.saved_step: int | None = None
        # -- checkpoints by steps or wall time, written in the background (parallel.train.persist.writer.Writer) --
        self.writer = writer.Writer(background=cfg.run.checkpoint_background)
        self._saved_t = time.perf_counter()
        self._run_s_before = 0.0  # run seconds of earlier sessions (a resumed run)
        if self.resuming:
            self._resume()
        guard = NonFiniteGuard(cfg.train.nonfinite, cfg.train.max_skipped_steps, self.progress, self._last_good)
        self.train_step = TrainStep(cfg, family, grid, self.model, self.pmodel, self.optimizer, scaler,
                                    self.schedule, self.progress, guard)
        n_params = sum(p.numel() for p in self.model.parameters())
        log.info("%s: %.2fM parameters, volume %s, %d train / %d val samples, %d steps per epoch",
                 family.name, n_params / 1e6, self.data.volume, self.data.n_train, self.data.n_val,
                 self.steps_per_epoch)
        self.ml.event(C.TRAIN_SAMPLES, self.data.n_train)
        self.ml.event(C.EVAL_SAMPLES, self.data.n_val)

    # -- checkpoints -----------------------------------------------------------------
    def _resume(self) -> None:
        ckpt, path = self._ckpt if self._ckpt is not None else checkpoint.load_latest(
            self.ckpt_path, map_location=self.grid.device)
        self._ckpt = None  # the loaded tensors are not kept
        self.state.load_state_dict(ckpt, path)
        self.saved_step = self.progress.step
        self._run_s_before = self.progress.run_s
        rng.restore_rng(ckpt, self.grid, self.cfg.train.seed, self.model)
        log.info("resumed from %s at step %d (epoch %d)", path, self.progress.step, self.progress.epoch)

    def save(self, run_s: float) -> None:
        self.progress.run_s = run_s
        self.writer.save(self.ckpt_path, self.grid, self.state.state_dict(self.grid), self.model,
                         keep=self.cfg.run.keep_checkpoints)
        self.saved_step = self.progress.step
        self._saved_t = time.perf_counter()

    def _checkpoint_due(self, step: int) -> bool:
        """``run.checkpoint_every`` steps, or ``run.checkpoint_every_s`` seconds (rank 0's clock), passed."""
        run = self.cfg.run
        if run.checkpoint_every and step % run.checkpoint_every == 0:
            return True
        return run.checkpoint_every_s > 0 and writer.wall_due(self.grid, self._saved_t, run.checkpoint_every_s)

    def _last_good(self) -> str:
        """Which checkpoint a run stopped for non-finite numbers can resume from."""
        self.writer.wait()  # the one being written is complete before it is named
        return (f"the last good checkpoint is {self.ckpt_path} (step {self.saved_step})"
                if self.saved_step is not None else "no checkpoint was written yet")

    # -- the run -----------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to the end (epochs, ``train.max_steps`` or the target); the summary."""
        cfg, grid, fam, p = self.cfg, self.grid, self.family, self.progress
        spe = self.steps_per_epoch
        total = cfg.train.epochs * spe
        if cfg.train.max_steps:
            total = min(total, cfg.train.max_steps)
        rep = Reporter(cfg.run, grid, total, p.step, self.resuming)
        first_step, first_samples = p.step, p.samples  # this session's figures start here
        times = StepTimes(grid.device)  # each step: compute, halo exchange, all-reduce, data wait
        prof = StepProfiler(cfg.train.profile, cfg.run.dir, grid.rank, grid.device) if cfg.train.profile else None
        self._io0 = (p.io.bytes_read, p.io.wait_seconds, p.io.samples)
        self.ml.end(C.INIT_STOP)
        self.ml.start(C.RUN_START)
        t_run = time.perf_counter() - p.run_s
        train_s = 0.0
        status, last_eval_step = "aborted", -1
        metric_key = f"val_{fam.metric_name}"
        loss_sum, loss_n, t_log, n_log = torch.zeros((), device=grid.device), 0, time.perf_counter(), 0
        done = p.step >= total or (p.best is not None and fam.reached(p.best, self.target)
                                       and cfg.train.stop_at_target)
        while not done:
            in_epoch = p.step - p.epoch * spe
            self.data.train.set_epoch(p.epoch, in_epoch)
            self.ml.start(C.EPOCH_START, epoch_num=p.epoch + 1)
            t_epoch = time.perf_counter()
            for batch, stats in self.data.train:
                with times.step(stats.wait_seconds), fixed_shapes(self.pmodel, self.data):
                    loss_sum += self.train_step(batch)  # fixed shapes: no per-forward all-gather of block sizes
                if prof is not None:
                    prof.step()
                loss_n += 1
                n_log += 1
                p.step += 1
                p.samples += cfg.train.global_batch_size
                p.io.add(stats)
                if p.step % cfg.run.log_every == 0 or p.step == total:
                    mean_loss = _data_mean(loss_sum / max(loss_n, 1), grid)
                    dt = time.perf_counter() - t_log
                    values = {"loss": mean_loss, "lr": self.train_step.lr,
                              "samples_per_s": n_log * cfg.train.global_batch_size / max(dt, 1e-9),
                              "data_wait_s": float(stats.wait_seconds),
                              "elapsed_s": time.perf_counter() - t_run, **times.log_values()}
                    rep.record("train", p.step, p.step / spe, values, self._per_rank())
                    rep.progress(p.step, {"loss": mean_loss, "lr": self.train_step.lr,
                                             fam.metric_name: p.best if p.best is not None else "-"})
                    loss_sum, loss_n, t_log, n_log = torch.zeros((), device=grid.device), 0, time.perf_counter(), 0
                if self._checkpoint_due(p.step):
                    self.save(time.perf_counter() - t_run)
                if self.stop is not None and p.step < total and self.stop.due():
                    self.save(time.perf_counter() - t_run)  # as a checkpoint_every save: a resume goes on from here
                    self.stop.step = p.step
                    log.warning("run.stop_signal %s: stopped after step %d of %d; checkpoint %s; resume with "
                                "train.resume=true", self.stop.signum.name, p.step, total, self.ckpt_path)
                    break
                if p.step >= total:
                    break
            if self.stop is not None and self.stop.step is not None:
                break
            train_s += time.perf_counter() - t_epoch
            self.ml.end(C.EPOCH_STOP, epoch_num=p.epoch + 1)
            finished_epoch = p.step % spe == 0
            if finished_epoch:
                p.epoch += 1
            want_eval = (finished_epoch and evaluation_due(p.epoch, cfg.train.eval_every, cfg.eval.start_epoch)) \
                or (p.step >= total and cfg.train.eval_at_end)
            if want_eval:
                values = self._evaluate(rep, t_run)
                last_eval_step = p.step
                if fam.reached(values[metric_key], self.target) and cfg.train.stop_at_target:
                    status, done = "success", True
            if p.step >= total:
                done = True
            if finished_epoch or done:
                self.save(time.perf_counter() - t_run)
        if status != "success" and p.best is not None and fam.reached(p.best, self.target):
            status = "success"
        if prof is not None:
            prof.close()
        self.writer.finish(grid)  # the last checkpoint is on disk before the run counts as ended
        run_s = time.perf_counter() - t_run
        self.ml.end(C.RUN_STOP, status=status)  # MLPerf knows only success and aborted
        if status != "success":  # the summary says why the run ended
            status = "max_steps" if cfg.train.max_steps and p.step >= cfg.train.max_steps else "completed"
        if self.stop is not None:
            self.stop.close()
            status = "stopped_by_signal" if self.stop.step is not None else status
        session = {"first_step": first_step, "steps": p.step - first_step, "samples": p.samples - first_samples,
                   "train_seconds": train_s}
        self.ml.close()
        per_rank = self._per_rank()
        summary = summarize(grid, {
            "status": status, "steps": p.step, "epochs": p.step / spe, "metric": metric_key,
            "best_metric": p.best, "target": self.target, "time_to_target_s": p.reached_s,
            "run_seconds": run_s - self._run_s_before, "run_seconds_all_sessions": run_s, "train_seconds": train_s,
            "samples_per_s": session["samples"] / train_s if train_s > 0 else 0.0, "session": session,
            "run_dir": cfg.run.dir, "checkpoints": self.writer.costs(),
            "last_eval_step": last_eval_step, "skipped_steps": p.skipped_steps,
            "conv_paths": conv_paths(self.pmodel),  # how the split convolutions ran (parallel.conv_path)
            "channels_last": self.channels_last,  # the activations' layout (parallel.channels_last)
            "clipped_steps": self.train_step.clipped,  # this session's steps whose gradients were clipped
            "skipped_samples": int(round(_data_mean(torch.tensor(float(p.skipped_samples), device=grid.device), grid)
                                         * grid.data_size)),
        }, per_rank, p.samples)
        summary.update(step_time_fields(gather_per_rank(times.session_means(), grid)))
        rep.close()
        if grid.rank == 0:
            path = Path(cfg.run.dir) / "summary.json"
            path.write_text(json.dumps(summary, indent=1), encoding="utf-8")
        log.info("summary (%s):\n%s", Path(cfg.run.dir) / "summary.json", format_summary(summary))
        c = self.writer.costs()
        log.info("checkpoints: %d written (%s), %.3f s of the steps each (RNG gather, copy, wait for the previous "
                 "write), %.3f s writing each", c["written"], "in the background" if c["background"] else "blocking",
                 c["step_seconds_each"], c["write_seconds_each"])
        return summary

    def _evaluate(self, rep: Reporter, t_run: float) -> dict[str, Any]:
        fam, p = self.family, self.progress
        epoch_num = p.epoch if p.step % self.steps_per_epoch == 0 else p.epoch + 1
        self.ml.start(C.EVAL_START, epoch_num=epoch_num)
        values = evaluate(self.pmodel, self.data.val.loader, fam, self.grid, self.cfg, p.epoch)
        metric = values[f"val_{fam.metric_name}"]
        self.ml.event(fam.mlperf_eval_key, metric, epoch_num=epoch_num)
        self.ml.end(C.EVAL_STOP, epoch_num=epoch_num)
        if p.best is None or (metric < p.best if fam.goal == "min" else metric > p.best):
            p.best = metric
        if p.reached_s is None and fam.reached(metric, self.target):
            p.reached_s = time.perf_counter() - t_run
        values["elapsed_s"] = time.perf_counter() - t_run
        rep.record("eval", p.step, p.step / self.steps_per_epoch, values)
        rep.progress(p.step, {fam.metric_name: metric, "best": p.best})
        log.info("step %d epoch %d: val loss %.5f, %s %.5f (target %s)", p.step, p.epoch,
                 values["val_loss"], fam.metric_name, metric, self.target)
        return values

    def _per_rank(self) -> torch.Tensor:
        io = self.progress.io
        b0, w0, s0 = getattr(self, "_io0", (0, 0.0, 0))  # this session's reading only
        return gather_per_rank([peak_memory_bytes(self.grid.device), io.bytes_read - b0, io.wait_seconds - w0,
                                io.samples - s0, peak_reserved_bytes(self.grid.device)], self.grid)


def _data_mean(x: torch.Tensor, grid: Grid) -> float:
    """The mean over data groups of a value replicated within each spatial group."""
    x = x.detach().clone().double()
    if grid.data_size > 1:
        comm.all_reduce_(x, grid.data_group, "avg", caller="loop._data_mean")
    return float(x)

