"""Config-only checks: the values Hydra's types cannot check (lengths, signs, ranges,
crop and evaluation settings, the schedule, K-FAC's settings), before any file is read
or any process group started; and the volumes the config makes the network see.

``validate_config`` raises ``ConfigError`` naming the first key whose value cannot work.
"""

from __future__ import annotations

from typing import Any, Sequence

from parallel.job.config import EvalConfig, JobConfig, OptimConfig, ScheduleConfig
from parallel.job.errors import ConfigError

Shape = tuple[int, int, int]


def is_auto(spatial: Any) -> bool:
    """Whether ``parallel.spatial`` asks the planner to choose (``auto``)."""
    return isinstance(spatial, str) and spatial == "auto"


def validate_config(cfg: JobConfig) -> None:
    """Raise ``ConfigError`` naming the first key whose value cannot work."""
    spatial = cfg.parallel.spatial
    spatial_ok = is_auto(spatial) or isinstance(spatial, (list, tuple)) and len(spatial) == 3 and all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in spatial)
    checks: list[tuple[bool, str]] = [
        (spatial_ok, f"parallel.spatial={spatial}: want three positive ints [sd, sh, sw] or auto"),
        (isinstance(cfg.parallel.overlap_halo, bool) or cfg.parallel.overlap_halo == "auto",
         f"parallel.overlap_halo={cfg.parallel.overlap_halo}: want true, false or auto"),
        (isinstance(cfg.parallel.channels_last, bool) or cfg.parallel.channels_last == "auto",
         f"parallel.channels_last={cfg.parallel.channels_last}: want true, false or auto"),
        (cfg.parallel.timeout_s > 0, f"parallel.timeout_s={cfg.parallel.timeout_s}: want > 0"),
        (cfg.parallel.heartbeat_s > 0, f"parallel.heartbeat_s={cfg.parallel.heartbeat_s}: want > 0"),
        (cfg.train.global_batch_size >= 1,
         f"train.global_batch_size={cfg.train.global_batch_size}: want >= 1"),
        (cfg.train.accum_steps >= 1, f"train.accum_steps={cfg.train.accum_steps}: want >= 1"),
        (cfg.train.epochs >= 1, f"train.epochs={cfg.train.epochs}: want >= 1"),
        (cfg.train.max_steps >= 0, f"train.max_steps={cfg.train.max_steps}: want >= 0"),
        (cfg.train.profile >= 0, f"train.profile={cfg.train.profile}: want >= 0 (steps to trace; 0: off)"),
        (cfg.train.max_skipped_steps >= 0, f"train.max_skipped_steps={cfg.train.max_skipped_steps}: want >= 0"),
        (cfg.train.replica_check_every >= 0,
         f"train.replica_check_every={cfg.train.replica_check_every}: want >= 0 (0: off)"),
        (cfg.train.spike_factor == 0 or cfg.train.spike_factor > 1,
         f"train.spike_factor={cfg.train.spike_factor}: want 0 (off) or > 1 (times the running average)"),
        (not cfg.train.replay or str(cfg.optim.name) != "kfac",
         "train.replay=true with optim.name=kfac: a replayed step would count K-FAC's captured statistics twice"),
        (not cfg.train.replay or str(cfg.train.precision) != "fp16",
         "train.replay=true with train.precision=fp16: the loss scaler skips overflowing steps itself"),
        (cfg.data.workers >= 0, f"data.workers={cfg.data.workers}: want >= 0"),
        (cfg.run.keep_checkpoints >= 1, f"run.keep_checkpoints={cfg.run.keep_checkpoints}: want >= 1"),
        (cfg.run.log_every >= 1, f"run.log_every={cfg.run.log_every}: want >= 1"),
        (cfg.run.checkpoint_every >= 0, f"run.checkpoint_every={cfg.run.checkpoint_every}: want >= 0"),
        (cfg.optim.lr > 0, f"optim.lr={cfg.optim.lr}: want > 0"),
        (str(cfg.parallel.verify).lower() in ("auto", "true", "false"),
         f"parallel.verify={cfg.parallel.verify}: want auto, true or false"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    try:
        check_schedule(cfg.sched, cfg.optim, cfg.train.global_batch_size)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _validate_crop_and_eval(cfg)
    import torch

    from parallel.model.compiled import refusal

    gpu = cfg.parallel.backend == "nccl" or (cfg.parallel.backend is None and torch.cuda.is_available())
    why = refusal(cfg.train.compile, str(cfg.optim.name), "cuda" if gpu else "cpu")
    if why:
        raise ConfigError(why)
    if str(cfg.optim.name) == "kfac":
        _validate_kfac(cfg)


def check_schedule(sched: ScheduleConfig, optim: OptimConfig, global_batch_size: int) -> None:
    """Raise ``ValueError`` naming the keys of a schedule that cannot be meant: a warmup
    whose start is above its peak (it would lower the rate), an offset other than 0 or 1."""
    if sched.warmup_epochs > 0:
        peak = optim.peak_lr(global_batch_size)
        start = optim.lr if sched.warmup_start_lr is None else sched.warmup_start_lr
        if start > peak:
            origin = ("optim.lr (sched.warmup_start_lr unset)" if sched.warmup_start_lr is None
                      else "sched.warmup_start_lr")
            scaled = (f" = optim.lr={optim.lr} x train.global_batch_size={global_batch_size} / "
                      f"optim.lr_scale_batch={optim.lr_scale_batch}" if optim.lr_scale_batch else " (optim.lr)")
            raise ValueError(
                f"the warmup (sched.warmup_epochs={sched.warmup_epochs}) starts at {origin} = {start:g}, above "
                f"its peak {peak:g}{scaled}: it would lower the rate. Set sched.warmup_epochs=0, or "
                f"sched.warmup_start_lr at most {peak:g}")
    if sched.warmup_epoch_offset not in (0, 1):
        raise ValueError(f"sched.warmup_epoch_offset={sched.warmup_epoch_offset}: want 0 (CosmoFlow's reference) "
                         "or 1 (the U-Net's)")


def _validate_crop_and_eval(cfg: JobConfig) -> None:
    """``ConfigError`` for crop and evaluation settings that cannot work (no files needed)."""
    crop = cfg.data.crop
    if crop is not None and (len(crop) != 3 or min(int(c) for c in crop) < 1):
        raise ConfigError(f"data.crop={list(crop)}: want three positive sizes [D, H, W] or null")
    if not 0.0 <= cfg.data.oversampling <= 1.0:
        raise ConfigError(f"data.oversampling={cfg.data.oversampling}: a probability, want 0 <= p <= 1")
    ev = cfg.eval
    if ev.window is not None and (len(ev.window) != 3 or min(int(w) for w in ev.window) < 1):
        raise ConfigError(f"eval.window={list(ev.window)}: want three positive sizes [D, H, W] or null")
    if not 0.0 <= ev.overlap < 1.0:
        raise ConfigError(f"eval.overlap={ev.overlap}: want 0 <= overlap < 1")
    if str(ev.mode) == "sliding" and window(cfg.eval, cfg.data.crop) is None:
        raise ConfigError("eval.mode=sliding needs a window: set eval.window=[D,H,W] or data.crop=[D,H,W] "
                          "(the reference's window is the crop), or eval.mode=whole")
    if ev.start_epoch < 0:
        raise ConfigError(f"eval.start_epoch={ev.start_epoch}: want >= 0 (0: every train.eval_every epochs)")
    if str(ev.mode) == "sliding":
        from parallel.infer.windows import plan_windows

        w = window(cfg.eval, cfg.data.crop)
        try:
            plan_windows(w, w, ev.overlap)  # type: ignore[arg-type]
        except ValueError as err:
            raise ConfigError(f"eval.overlap={ev.overlap} with the window {list(w)}: "  # type: ignore[arg-type]
                              f"{err}") from None


def _validate_kfac(cfg: JobConfig) -> None:
    """``optim.kfac``'s settings, and what K-FAC's base step (torch's SGD) cannot do."""
    try:
        cfg.optim.kfac.validate()
    except ValueError as err:  # its messages name the field as kfac.<name>
        raise ConfigError(f"optim.{err}") from None
    if str(cfg.optim.momentum_form) == "keras":
        raise ConfigError("optim.momentum_form=keras: optim.name=kfac takes torch's SGD step on the "
                          "preconditioned gradients (b = m b + g; p -= lr b); set optim.momentum_form=torch")


def window(ev: EvalConfig, crop: Sequence[int] | None) -> Shape | None:
    """The sliding window of the job's evaluation: ``eval.window``, else the crop (``data.crop``)."""
    w = ev.window if ev.window is not None else crop
    return tuple(int(v) for v in w) if w is not None else None  # type: ignore[return-value]


def train_volume(crop: Sequence[int] | None, volume: Sequence[int]) -> Shape:
    """The volume the network trains on: the crop (``data.crop``), or the cases'
    (``volume``: the first case's)."""
    v = crop if crop is not None else volume
    return tuple(int(n) for n in v)  # type: ignore[return-value]
