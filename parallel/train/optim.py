"""Optimiser and learning-rate schedule.

The schedule is a pure function of the step (and steps per epoch), so resuming needs
only the step count: no scheduler object state to save beyond it.

- MLPerf CosmoFlow: ``optim.lr=0.001 optim.lr_scale_batch=64 sched.warmup_epochs=4
  sched.decay=step sched.decay_epochs=[32,64] sched.decay_factors=[0.25,0.125]``: warm up
  linearly from the unscaled LR to lr x batch/64, then replace the peak by 0.25x and
  0.125x at epochs 32 and 64.
- MLPerf U-Net: ``optim.lr=0.8 optim.nesterov=true sched.warmup_epochs=200
  sched.warmup_start_lr=1e-4``: linear warmup from 1e-4 to 0.8, then constant.
"""

from __future__ import annotations

import bisect
import math
from typing import Iterable

import torch

from parallel.train.config import OptimConfig, ScheduleConfig


def peak_lr(cfg: OptimConfig, global_batch_size: int) -> float:
    """The LR after warmup: ``lr``, scaled linearly with the batch if ``lr_scale_batch`` is set."""
    if cfg.lr_scale_batch:
        return cfg.lr * global_batch_size / cfg.lr_scale_batch
    return cfg.lr


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """SGD (momentum, optional Nesterov) or AdamW, from section ``optim``."""
    params = list(params)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay)
    if cfg.name == "adamw":
        if len(cfg.betas) != 2:
            raise ValueError(f"optim.betas needs two values, got {list(cfg.betas)}")
        return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps,
                                 weight_decay=cfg.weight_decay)
    raise ValueError(f"optim.name must be sgd or adamw, got {cfg.name!r}")


class Schedule:
    """LR at any step: linear warmup, then constant, step decay or cosine decay."""

    def __init__(self, cfg: ScheduleConfig, optim: OptimConfig, global_batch_size: int,
                 steps_per_epoch: int, epochs: int) -> None:
        if len(cfg.decay_epochs) != len(cfg.decay_factors):
            raise ValueError(
                f"sched.decay_epochs has {len(cfg.decay_epochs)} entries but sched.decay_factors "
                f"has {len(cfg.decay_factors)}: they pair up one to one"
            )
        if list(cfg.decay_epochs) != sorted(cfg.decay_epochs):
            raise ValueError(f"sched.decay_epochs must be increasing, got {list(cfg.decay_epochs)}")
        if steps_per_epoch < 1:
            raise ValueError(f"steps per epoch must be >= 1, got {steps_per_epoch}")
        self.cfg = cfg
        self.peak = peak_lr(optim, global_batch_size)
        self.start = optim.lr if cfg.warmup_start_lr is None else cfg.warmup_start_lr
        self.steps_per_epoch = steps_per_epoch
        self.epochs = epochs

    def lr(self, step: int) -> float:
        """The LR used by optimiser step ``step`` (0-based)."""
        epoch = step / self.steps_per_epoch
        cfg = self.cfg
        if cfg.warmup_epochs > 0 and epoch < cfg.warmup_epochs:
            return self.start + (self.peak - self.start) * epoch / cfg.warmup_epochs
        if cfg.decay == "step":
            i = bisect.bisect_right(list(cfg.decay_epochs), epoch)
            return self.peak * (cfg.decay_factors[i - 1] if i > 0 else 1.0)
        if cfg.decay == "cosine":
            span = max(self.epochs - cfg.warmup_epochs, 1e-9)
            t = min(max(epoch - cfg.warmup_epochs, 0.0) / span, 1.0)
            return cfg.min_lr + (self.peak - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * t))
        return self.peak

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set the LR of every parameter group for ``step``; returns it."""
        lr = self.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
