"""Optimiser and learning-rate schedule.

The schedule is a pure function of the step (and steps per epoch), so resuming needs
only the step count: no scheduler object state to save beyond it.

- MLPerf CosmoFlow (HPC reference): ``optim.lr=0.001 optim.lr_scale_batch=64
  sched.warmup_epochs=4 sched.decay=step sched.decay_epochs=[32,64]
  sched.decay_factors=[0.25,0.125] sched.per_epoch=true sched.decay_boundary=after
  optim.momentum_form=keras``: the LR is set once per epoch ``e`` (0-based) to
  0.001 + (peak - 0.001) e / 4 for e < 4, then to the peak times the factor of the last
  boundary ``b < e`` (so epoch 33 is the first at 0.25x), with peak = 0.001 x batch / 64;
  momentum with the LR inside the velocity, as Keras computes it.
- MLPerf U-Net: ``optim.lr=0.8 optim.nesterov=true sched.warmup_epochs=200
  sched.warmup_start_lr=1e-4 sched.per_epoch=true sched.warmup_epoch_offset=1``: epoch
  ``e`` (0-based) of the warmup at 1e-4 + (0.8 - 1e-4) (e + 1) / 200, then 0.8.
"""

from __future__ import annotations

import bisect
import math
from typing import Any, Collection, Iterable

import torch

from parallel.job.config import OptimConfig, ScheduleConfig


class KerasSGD(torch.optim.Optimizer):
    """SGD with the learning rate inside the velocity, as Keras (and NVIDIA's CosmoFlow
    FixedSGD) compute it: v = m v + lr (g + wd p); p -= v, or with Nesterov
    p -= m v + lr (g + wd p). Equal to torch's SGD while the LR is constant; when it
    changes, the velocity keeps the old LR's steps instead of rescaling them."""

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, m, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad if wd == 0 else p.grad.add(p, alpha=wd)
                v = self.state[p].get("velocity")
                if v is None:
                    v = self.state[p]["velocity"] = torch.zeros_like(p)
                v.mul_(m).add_(g, alpha=lr)
                if group["nesterov"]:
                    p.sub_(v, alpha=m).sub_(g, alpha=lr)
                else:
                    p.sub_(v)
        return loss


def build_optimizer(params: Iterable[Any], cfg: OptimConfig,
                    decayed: Collection[str] | None = None, *, model: torch.nn.Module | None = None,
                    grid: Any = None, grad_scaler: Any = None) -> torch.optim.Optimizer:
    """SGD (momentum, optional Nesterov, torch's or Keras' form), AdamW or K-FAC, from ``optim``.

    ``params``: parameters, or ``(name, parameter)`` pairs (``model.named_parameters()``).
    ``decayed``: names of the only parameters that weight decay applies to (the MLPerf
    CosmoFlow reference decays the hidden dense layers' weights alone); None: all.
    K-FAC (``optim.name=kfac``) also needs ``model`` (the ``ParallelModule`` or the serial
    model: its hooks capture the factors), ``grid`` (None: one process) and the fp16
    ``grad_scaler`` whose scale its captured gradients carry.
    """
    items = list(params)
    groups: list[dict[str, Any]] | list[torch.nn.Parameter]
    if decayed is not None:
        if items and not isinstance(items[0], tuple):
            raise ValueError("weight decay on chosen parameters needs (name, parameter) pairs: "
                             "pass model.named_parameters()")
        wanted = set(decayed)
        # the parallel wrapper's names carry a "module." prefix; the serial model's do not
        items = [(n[len("module."):] if n.startswith("module.") else n, p) for n, p in items]
        unknown = wanted - {n for n, _ in items}
        if unknown:
            raise ValueError(f"weight decay names parameters the model does not have: {sorted(unknown)}")
        groups = [{"params": [p for n, p in items if n in wanted], "weight_decay": cfg.weight_decay},
                  {"params": [p for n, p in items if n not in wanted], "weight_decay": 0.0}]
    else:
        groups = [p[1] if isinstance(p, tuple) else p for p in items]
    if cfg.name == "sgd":
        if cfg.momentum_form == "keras":
            return KerasSGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                            weight_decay=cfg.weight_decay)
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay)
    if cfg.name == "kfac":
        if model is None:
            raise ValueError("optim.name=kfac needs the model: build_optimizer(..., model=pmodel, grid=grid)")
        if cfg.momentum_form == "keras":
            raise ValueError("optim.name=kfac takes torch's SGD step: set optim.momentum_form=torch")
        from parallel.kfac import KFAC

        return KFAC(model, grid, cfg.kfac, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                    weight_decay=cfg.weight_decay, grad_scaler=grad_scaler, params=groups)
    if cfg.name == "adamw":
        if len(cfg.betas) != 2:
            raise ValueError(f"optim.betas needs two values, got {list(cfg.betas)}")
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps,
                                 weight_decay=cfg.weight_decay)
    raise ValueError(f"optim.name must be sgd, adamw or kfac, got {cfg.name!r}")


class Schedule:
    """LR at any step: linear warmup, then constant, step decay or cosine decay; per step
    (fractional epochs) or held per epoch (``sched.per_epoch``)."""

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
        self.peak = optim.peak_lr(global_batch_size)
        self.start = optim.lr if cfg.warmup_start_lr is None else cfg.warmup_start_lr
        self.steps_per_epoch = steps_per_epoch
        self.epochs = epochs

    def lr(self, step: int) -> float:
        """The LR used by optimiser step ``step`` (0-based)."""
        cfg = self.cfg
        whole = step // self.steps_per_epoch
        epoch = float(whole) if cfg.per_epoch else step / self.steps_per_epoch
        if cfg.warmup_epochs > 0 and epoch < cfg.warmup_epochs:
            done = epoch + (cfg.warmup_epoch_offset if cfg.per_epoch else 0)
            return self.start + (self.peak - self.start) * done / cfg.warmup_epochs
        if cfg.decay == "step":
            bounds = list(cfg.decay_epochs)
            if cfg.decay_boundary == "after":
                i = bisect.bisect_left(bounds, whole)  # boundaries b < epoch
            else:
                i = bisect.bisect_right(bounds, epoch)  # boundaries b <= epoch
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
