"""A training job built top to bottom on its grid, run, and summed up: what ``train()``
does once the process group runs and the run directory is settled.

``build_job`` goes down in plain calls and returns the built ``Job``, whose ``run`` trains
and sums up (``run_job`` does both); nothing built is handed back to be finished:

1. the checks that need the grid (``parallel.train.checks.on_grid``: every sample file,
   every case against the network and the split) and the memory budget;
2. a resume's checkpoint, read and checked against this model before any file of the
   run is written; then the run's ``config.yaml`` and the MLPerf log's first keys;
3. the readers (staging first, if asked);
4. the serial model, its split form (``parallel.parallelize``), checked against its
   serial self (``parallel.verify``), compiled if asked;
5. optimiser, schedule, state (the resume restored), the step;
6. the observers (profiler, metrics and TensorBoard, checkpoints, MLPerf log) and the
   loop, which runs to the end it decides;
7. the summary (``summary.json``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from mlperf_logging.mllog import constants as C
from torch import nn

import parallel
from parallel import comm
from parallel.grid import Grid
from parallel.job import checkpoint
from parallel.job.config import JobConfig
from parallel.job.errors import InputError
from parallel.job.family import Family
from parallel.job.usermodel import is_user_model
from parallel.model.compiled import compile_model
from parallel.model.random_draws import stream_seed
from parallel.runtime.memory import reset_peak
from parallel.split import layout
from parallel.train import elastic, faults, stopsignal
from parallel.train.checks import JobPlan, budget, equivalence, on_grid
from parallel.train.data import build_data
from parallel.train.evaluate import Evaluator
from parallel.train.loop import Ending, EvalSchedule, Loop
from parallel.train.observe.checkpoints import Checkpoints
from parallel.train.observe.events import Observers, RunClock, RunEnd
from parallel.train.observe.mlperf import MLPerfEvents, log_submission, open_log
from parallel.train.observe.noisescale import NoiseScale
from parallel.train.observe.profile import StepProfiler
from parallel.train.observe.report import Reporter
from parallel.train.observe.steptime import StepTimes
from parallel.train.observe.steptime import summary_fields as step_time_fields
from parallel.train.observe.summary import conv_paths, data_mean, format_summary, gather_per_rank, per_rank, summarize
from parallel.train.optim import Schedule, build_optimizer
from parallel.train.persist import rng
from parallel.train.persist.state import TrainState, plain_config
from parallel.train.persist.writer import Writer
from parallel.train.precision import LossScaler
from parallel.train.replay import Replay
from parallel.train.replicas import ReplicaCheck
from parallel.train.step import NonFiniteGuard, TrainStep

log = logging.getLogger("parallel.train")


@dataclass
class Job:
    """A job built on its grid: ``run`` trains to the end the loop decides and returns the
    summary. ``loop`` holds the step, the readers and the observers."""

    cfg: JobConfig
    grid: Grid
    loop: Loop
    train_step: TrainStep
    saver: Checkpoints
    pmodel: Any
    channels_last: bool
    memory: Any
    target: float
    stop: Any
    first: tuple
    run_s_before: float
    replicas: ReplicaCheck | None = None
    replay: Replay | None = None

    def run(self) -> dict[str, Any]:
        """Train (collective: every rank); the summary, which rank 0 also writes as
        ``run.dir/summary.json``."""
        end = self.loop.fit()
        if self.stop is not None:
            self.stop.close()
        return _summary(self, end)


def run_job(cfg: JobConfig, family: Family, grid: Grid, plan: JobPlan, writer: Writer,
            regrid: elastic.Regrid | None = None, save_config: Any = None, watchdog: Any = None) -> dict[str, Any]:
    """``build_job(...).run()``: the job built on ``grid``, run; its summary."""
    return build_job(cfg, family, grid, plan, writer, regrid, save_config, watchdog).run()


def build_job(cfg: JobConfig, family: Family, grid: Grid, plan: JobPlan, writer: Writer,
              regrid: elastic.Regrid | None = None, save_config: Any = None, watchdog: Any = None) -> Job:
    """Build the job on ``grid`` from ``plan`` (``parallel.train.checks.before_grid``)
    (collective: every rank). ``writer`` writes its checkpoints; ``regrid``: this session's
    grid in an elastic run; ``save_config()`` writes the run's ``config.yaml`` once a
    resume is known to proceed; ``watchdog``: the job's (a rank over the memory budget
    reports through it)."""
    stop = stopsignal.arm(cfg.run.stop_signal, grid)  # first: the signal may come during start-up
    plan = on_grid(plan, cfg, family, grid)
    memory = budget.start(cfg, family, grid, plan.facts, watchdog)
    meta = {"family": family.name, "volume": list(plan.volume), "model": plain_config(cfg.model)}
    path = checkpoint.checkpoint_path(cfg.run.dir)
    resume = _read_resume(path, meta, grid) if cfg.train.resume and path.is_file() else None
    if save_config is not None:
        save_config()
    if grid.rank == 0:
        Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
    comm.barrier(grid.world_group, caller="job: run.dir ready")
    ml = (elastic.open_continued_log(cfg.run, grid, regrid) if elastic.continues_log(cfg.run, cfg.mlperf, resume is not None)
          else open_log(cfg.run, cfg.mlperf, grid))
    log_submission(ml, cfg, grid, family.name, n_nodes=grid.node_count)
    ml.start(C.STAGING_START)
    data = build_data(cfg.data, cfg.eval, cfg.train, family, grid, plan.facts)
    ml.end(C.STAGING_STOP, staging_duration=data.staging_seconds)
    model, pmodel, channels_last = _build_model(cfg, family, grid, plan)
    torch.manual_seed(stream_seed(cfg.train.seed, grid.data_rank))  # one global stream per data group
    scaler = LossScaler() if cfg.train.precision == "fp16" else None  # its decisions from the global norm
    optimizer = _optimizer(cfg, family, grid, model, pmodel, scaler)
    spe = len(data.train)
    schedule = Schedule(cfg.sched, cfg.optim, cfg.train.global_batch_size, spe, cfg.train.epochs)
    state = TrainState(model, optimizer, scaler, spe, meta)
    p = state.progress
    if resume is not None:
        ckpt, used = resume
        state.load_state_dict(ckpt, used)
        rng.restore_rng(ckpt, grid, cfg.train.seed, model)
        log.info("resumed from %s at step %d (epoch %d)", used, p.step, p.epoch)
    run_s_before, first = p.run_s, (p.step, p.samples, (p.io.bytes_read, p.io.wait_seconds, p.io.samples))
    total = min(cfg.train.epochs * spe, cfg.train.max_steps) if cfg.train.max_steps else cfg.train.epochs * spe
    target = family.target if cfg.train.target is None else cfg.train.target
    clock, times = RunClock(), StepTimes(grid.device)
    saver = Checkpoints(writer, path, grid, state, model, cfg.run, clock, total,
                        saved_step=p.step if resume is not None else None,
                        stop_signal=stop.signum.name if stop is not None else None)
    guard = NonFiniteGuard(cfg.train.nonfinite, cfg.train.max_skipped_steps, p, saver.last_good)
    augment = (lambda fields, gen, g: family.augment(fields, gen, g, cfg)) if family.augment is not None else None
    noise = NoiseScale(cfg.train.global_batch_size, grid.data_size, cfg.train.noise_scale_decay,
                       enabled=cfg.train.noise_scale and getattr(pmodel, "noise_scale", False))
    step = TrainStep(cfg.train, family, grid, model, pmodel, optimizer, scaler, schedule, p, guard, augment, noise)
    if not noise.measured:
        log.info("gradient noise scale: not measured (%s)", noise.why_not)
    replicas = ReplicaCheck(cfg.train.replica_check_every, grid, model, pmodel, optimizer, saver.last_good)
    saver.record = replicas.record  # every checkpoint from agreeing replicas
    flip = faults.from_env(grid, model, optimizer)  # a test's fault; None in real runs
    if flip is not None:
        step.after_sync = flip.after_sync
    replay = Replay(step, grid, model, p, cfg.train.spike_factor, data.train, spe) if cfg.train.replay else None
    log.info("%s: %.2fM parameters, volume %s, %d train / %d val samples, %d steps per epoch", family.name,
             sum(q.numel() for q in model.parameters()) / 1e6, data.volume, data.n_train, data.n_val, spe)
    ml.event(C.TRAIN_SAMPLES, data.n_train)
    ml.event(C.EVAL_SAMPLES, data.n_val)
    events = Observers([
        StepProfiler(cfg.train.profile, cfg.run.dir, grid.rank, grid.device) if cfg.train.profile else None,
        flip, replicas,  # after the update, before anything reports or keeps the step
        Reporter(cfg.run, grid, total, spe, p.step, resume is not None, clock, times, lambda: step.lr,
                 family.metric_name, target, cfg.train.global_batch_size, first[2], noise=noise),
        saver,
        MLPerfEvents(ml, family.mlperf_eval_key, f"val_{family.metric_name}"),
    ])
    ending = Ending(total, cfg.train.max_steps, cfg.train.stop_at_target, lambda m: m is not None and
                    family.reached(m, target), stop)
    loop = Loop(replay or step, pmodel, data, p, cfg.train.global_batch_size,
                Evaluator(pmodel, data.val.loader, family, grid, cfg.eval, cfg.data.crop, str(cfg.train.precision)),
                EvalSchedule(cfg.train.eval_every, cfg.eval.start_epoch, cfg.train.eval_at_end), ending,
                lambda a, b: a < b if family.goal == "min" else a > b, events, clock, times)
    return Job(cfg, grid, loop, step, saver, pmodel, channels_last, memory, target, stop, first, run_s_before,
               replicas, replay)


def _read_resume(path: Path, meta: dict[str, Any], grid: Grid) -> tuple[dict[str, Any], Path]:
    """The checkpoint a resume continues from (the newest readable one), checked against
    this job's model before any log is moved or cut: another model's is ``InputError``
    (exit 2, like other config errors)."""
    ckpt, used = checkpoint.load_latest(path, map_location=grid.device)
    try:
        checkpoint.check_matches(ckpt, meta, used)
    except checkpoint.CheckpointError as err:
        raise InputError(str(err)) from None
    return ckpt, used


def _build_model(cfg: JobConfig, family: Family, grid: Grid, plan: JobPlan) -> tuple[nn.Module, Any, bool]:
    """The serial model (the same initial weights at every grid), its split form for
    ``grid``, checked against its serial self before the first step and compiled if
    asked; and whether its activations run channels-last."""
    torch.manual_seed(cfg.train.seed)
    model = family.build_model(cfg.model, plan.volume)
    if cfg.train.precision == "fp64":  # weights (and, in the step, samples) in float64
        model.double()
    cl = cfg.parallel.channels_last  # auto: where NDHWC was measured faster (parallel.split.layout.preferred)
    channels_last = layout.preferred(grid.device, str(cfg.train.precision)) if cl == "auto" else bool(cl)
    serial = equivalence.serial_copy(cfg.parallel.verify, model, grid, is_user_model(cfg.model))
    # Flatten+Linear weights sharded by block, except under K-FAC, which preconditions the
    # whole weight (a sharded one would take the plain update, unlike the serial run) unless
    # it holds the layer's A hierarchically with its diagonal blocks on their ranks.
    shard: Any = True
    if str(cfg.optim.name) == "kfac":
        from parallel.kfac import shard_policy

        shard = shard_policy(cfg.optim.kfac)
    pmodel = parallel.parallelize(
        model, grid, seed=cfg.train.seed, overlap_halo=cfg.parallel.overlap_halo,
        recompute=cfg.train.activation_checkpointing, input_shape=(plan.facts.channels, *plan.volume),
        shard_linear=shard, channels_last=channels_last, conv_path=str(cfg.parallel.conv_path))
    equivalence.run(serial, pmodel, cfg.parallel.verify, cfg.train.seed, plan.volume, plan.facts.channels)
    if cfg.train.noise_scale:  # the hierarchical sync: each data group's gradient formed (parallel.model.gradsync)
        pmodel.measure_noise_scale(True)
    compile_model(pmodel, cfg.train.compile)  # after the eager model's check against serial
    reset_peak(grid.device)  # the summary's peaks are training's, not the float64 check's
    return model, pmodel, channels_last


def _optimizer(cfg: JobConfig, family: Family, grid: Grid, model: nn.Module, pmodel: Any,
               scaler: LossScaler | None) -> torch.optim.Optimizer:
    """The optimiser of ``cfg.optim``: weight decay only where the family's reference applies
    it (one group when there is none to apply); K-FAC hooks into the split model and takes
    the scale of its captured gradients out."""
    chosen = family.decayed is not None and not cfg.optim.decay_all and cfg.optim.weight_decay > 0
    decayed = family.decayed(model) if chosen else None  # type: ignore[misc]
    params = pmodel.named_parameters() if decayed is not None else pmodel.parameters()
    return build_optimizer(params, cfg.optim, decayed=decayed, model=pmodel, grid=grid, grad_scaler=scaler)


def _summary(job: Job, end: RunEnd) -> dict[str, Any]:
    """The run's summary (collective: every rank's figures are gathered); rank 0 writes
    ``run.dir/summary.json``."""
    cfg, grid, loop, saver = job.cfg, job.grid, job.loop, job.saver
    p = loop.progress
    first_step, first_samples, io_start = job.first
    run_s = loop.clock.now()
    train_s = loop.train_seconds
    session = {"first_step": first_step, "steps": p.step - first_step, "samples": p.samples - first_samples,
               "train_seconds": train_s}
    summary = summarize(grid, {
        "status": end.why, "steps": p.step, "epochs": p.step / loop.steps_per_epoch,
        "metric": loop.evaluate.metric_key, "best_metric": p.best, "target": job.target,
        "time_to_target_s": p.reached_s, "run_seconds": run_s - job.run_s_before, "run_seconds_all_sessions": run_s,
        "train_seconds": train_s, "samples_per_s": session["samples"] / train_s if train_s > 0 else 0.0,
        "session": session, "run_dir": cfg.run.dir, "checkpoints": saver.writer.costs(),
        "last_eval_step": loop.last_eval_step, "skipped_steps": p.skipped_steps,
        "replica_checks": job.replicas.costs() if job.replicas is not None else None,
        "replayed_steps": job.replay.costs() if job.replay is not None else None,
        "conv_paths": conv_paths(job.pmodel),  # how the split convolutions ran (parallel.conv_path)
        "channels_last": job.channels_last,  # the activations' layout (parallel.channels_last)
        "clipped_steps": job.train_step.clipped,  # this session's steps whose gradients were clipped
        "noise_scale": job.train_step.noise.summary() if job.train_step.noise is not None else None,
        "skipped_samples": int(round(data_mean(torch.tensor(float(p.skipped_samples), device=grid.device), grid)
                                     * grid.data_size)),
    }, per_rank(p.io, io_start, grid), p.samples)
    report = getattr(job.train_step.optimizer, "report", None)
    if callable(report):  # K-FAC: the layers preconditioned, the low-rank factors' ranks and memory
        summary["kfac"] = report()
    if job.memory is not None:  # the budget and the prediction beside the peaks
        summary.update(job.memory.summary_fields(summary["peak_memory_bytes_per_rank"]))
    summary.update(step_time_fields(gather_per_rank(loop.times.session_means(), grid)))
    path = Path(cfg.run.dir) / "summary.json"
    if grid.rank == 0:
        path.write_text(json.dumps(summary, indent=1), encoding="utf-8")
    log.info("summary (%s):\n%s", path, format_summary(summary))
    if job.train_step.noise is not None:
        log.info("%s", job.train_step.noise.line())
    c = saver.writer.costs()
    log.info("checkpoints: %d written (%s), %.3f s of the steps each (RNG gather, copy, wait for the previous "
             "write), %.3f s writing each", c["written"], "in the background" if c["background"] else "blocking",
             c["step_seconds_each"], c["write_seconds_each"])
    return summary
