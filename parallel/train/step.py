"""One optimiser step and its guard against non-finite numbers.

``TrainStep`` runs the augmentation, forward and backward over the accumulation
micro-batches, and the update. Every decision of the update that ranks must share is
taken from the global gradient norm (``parallel.train.gradnorm``: a sharded weight counted
once, summed over its spatial group), read on the host once per step with the loss:
whether the step is finite (``train.nonfinite``; the fp16 ``LossScaler``'s skip and next
scale) and how much the gradients are clipped (``train.grad_clip``).
``NonFiniteGuard`` applies the two policies: samples whose input block is non-finite on
any rank of the spatial group are left out (``data.nonfinite=skip``); a step whose
gradients are non-finite stops the run (``train.nonfinite=fail``) or is skipped, on every
rank alike.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Callable

import torch
from torch import nn

from parallel import comm
from parallel.grid import Grid
from parallel.job.config import TrainConfig
from parallel.job.family import Family
from parallel.train.data import Batch
from parallel.train.gradnorm import clip_coefficient, global_grad_norm, read_host, scale_grads_
from parallel.train.observe.noisescale import NoiseScale
from parallel.train.optim import Schedule
from parallel.train.persist.state import Progress
from parallel.train.precision import LossScaler, autocast, compute_dtype

log = logging.getLogger("parallel.train")


class NonFiniteError(RuntimeError):
    """The loss or the gradients became NaN or inf (the same decision on every rank)."""

    collective = True


class NonFiniteGuard:
    """The non-finite policies of one run.

    Args:
        policy: ``train.nonfinite`` (``fail`` or ``skip``).
        max_in_a_row: ``train.max_skipped_steps``.
        progress: where the skipped samples and steps are counted.
        last_good: says which checkpoint is the last good one (for the messages).
    """

    def __init__(self, policy: str, max_in_a_row: int, progress: Progress, last_good: Callable[[], str]) -> None:
        self.policy, self.max_in_a_row = str(policy), max_in_a_row
        self.progress, self.last_good = progress, last_good
        self.bad_in_a_row = 0

    def drop_samples(self, x: torch.Tensor, y: torch.Tensor, finite: torch.Tensor, grid: Grid
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Leave out samples whose block is non-finite on any rank of the spatial group."""
        good = finite.to(device=grid.device, dtype=torch.int32)
        if grid.spatial_size > 1:
            comm.all_reduce_(good, grid.spatial_group, "min", caller="step: non-finite samples")
        keep = good.bool()
        n_bad = int((~keep).sum())
        if n_bad:
            self.progress.skipped_samples += n_bad
            log.warning("step %d: %d sample(s) with non-finite input left out (data.nonfinite=skip); "
                        "%d so far in this data group", self.progress.step + 1, n_bad, self.progress.skipped_samples)
            x, y = x[keep], y[keep]
        return x, y

    def finite_step(self, model: nn.Module, norm: float, loss: float, spike: str | None = None) -> bool:
        """Whether the step may update: ``norm`` is the global gradient norm
        (``parallel.train.gradnorm``: the same on every rank, so every rank decides alike).

        Non-finite, or a ``spike`` (why the step is bad although finite: a replayed step's
        verdict, ``parallel.train.replay``): raise ``NonFiniteError`` (``fail``, or too many
        in a row) or drop the update and count it (``skip``).
        """
        step = self.progress.step + 1
        if math.isfinite(norm) and spike is None:
            self.bad_in_a_row = 0
            if not math.isfinite(loss):
                log.warning("step %d: the loss is %s on this rank but the gradients are finite", step, loss)
            return True
        if spike is not None:
            what = f"step {step}: {spike}"
        else:  # the first parameter whose gradient is non-finite on this rank (messages only)
            bad = next((n for n, p in model.named_parameters()
                        if p.grad is not None and not bool(torch.isfinite(p.grad).all())), "?")
            what = (f"step {step}: non-finite gradients (norm {norm}, first in '{bad}'; "
                    f"loss {loss:.6g} on this data group)")
        if self.policy == "fail":
            raise NonFiniteError(f"{what}; stopping (train.nonfinite=fail): {self.last_good()}. Resume with a lower "
                                 "optim.lr or train.grad_clip, or set train.nonfinite=skip")
        self.bad_in_a_row += 1
        if self.bad_in_a_row > self.max_in_a_row:
            raise NonFiniteError(f"{what}; {self.bad_in_a_row} steps in a row were non-finite "
                                 f"(train.max_skipped_steps={self.max_in_a_row}): {self.last_good()}")
        self.progress.skipped_steps += 1
        log.warning("%s: update skipped (train.nonfinite=skip; %d skipped so far)", what, self.progress.skipped_steps)
        return False


class TrainStep:
    """Forward, backward (accumulated over micro-batches) and update of one step.

    ``train``: the job's train section (seed, accumulation, precision, clipping, the
    non-finite test hook); ``model`` is the serial model (its parameter names), ``pmodel``
    its parallel form; ``augment(fields, generator, grid)``: the family's augmentation of
    the local batch (None: none).
    """

    def __init__(self, train: TrainConfig, family: Family, grid: Grid, model: nn.Module, pmodel: nn.Module,
                 optimizer: torch.optim.Optimizer, scaler: LossScaler | None, schedule: Schedule,
                 progress: Progress, guard: NonFiniteGuard,
                 augment: Callable[[dict, torch.Generator, Grid], dict] | None = None,
                 noise: NoiseScale | None = None) -> None:
        self.train, self.family, self.grid, self.augment = train, family, grid, augment
        self.model, self.pmodel, self.optimizer, self.scaler = model, pmodel, optimizer, scaler
        self.schedule, self.progress, self.guard = schedule, progress, guard
        self.lr = schedule.lr(progress.step)
        self.inject = set(train.inject_nonfinite)
        self.last_norm = 0.0  # the global gradient norm of the last step (before clipping)
        self.clipped = 0      # steps whose gradients were clipped
        self.cast = compute_dtype(train.precision)
        self.noise = noise  # the gradient noise scale, fed from the sync's data-group gradients
        self.after_sync: Callable[[int], None] | None = None  # test hook: a fault before the update
        # a judge of the step before its update (parallel.train.replay): may abort the step or
        # say why it is bad although finite
        self.suspect: Callable[[float, float], str | None] | None = None

    def __call__(self, batch: Batch) -> torch.Tensor:
        """One step on this rank's ``batch``; the local loss (zero for a skipped update)."""
        fam, grid = self.family, self.grid
        fields = batch.fields
        if self.cast is not None:  # train.precision=fp64: the float32 samples in the model's dtype
            fields = {k: v.to(self.cast) if v.is_floating_point() else v for k, v in fields.items()}
        if self.augment is not None:
            gen = torch.Generator().manual_seed(self.train.seed * 1_000_003 + self.progress.step)
            fields = self.augment(fields, gen, grid)
        x, y = fields[fam.input_field], fields[fam.target_field]
        if batch.finite is not None:
            x, y = self.guard.drop_samples(x, y, batch.finite, grid)
        accum = self.train.accum_steps
        # tensor_split: always `accum` pieces (some may be empty after skipped samples),
        # so every rank runs the same collectives
        xs, ys = torch.tensor_split(x, accum), torch.tensor_split(y, accum)
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=grid.device, dtype=self.cast or torch.float32)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            sync = contextlib.nullcontext() if i == accum - 1 else self.pmodel.no_sync()
            with sync:
                with autocast(self.train.precision, grid.device):
                    out = self.pmodel(xm)
                if len(ym):
                    loss = fam.loss(out, ym, grid) / accum
                else:  # nothing left to learn from: zero gradients, same collectives
                    loss = zero_loss(out)
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            total += loss.detach()
        self.lr = self.schedule.apply(self.optimizer, self.progress.step)
        return total if self.update(total) else torch.zeros((), device=grid.device, dtype=total.dtype)

    def update(self, loss: torch.Tensor) -> bool:
        """Unscale (fp16), decide, clip and step, every decision from the global gradient
        norm (``parallel.train.gradnorm``), read on the host once; whether the update ran."""
        params = list(self.pmodel.parameters())
        if self.progress.step + 1 in self.inject:
            inject_nonfinite(self.pmodel, self.grid)
        if self.after_sync is not None:
            self.after_sync(self.progress.step + 1)
        if self.scaler is not None:
            self.scaler.unscale_(params)
        sync = getattr(self.pmodel, "sync", None)
        measured = self.noise is not None and self.noise.measured and sync is not None and sync.measured
        extra = [sync.small_norm_sq()] if measured else []  # one scalar summed over every rank
        norm, loss_f, *small = read_host(global_grad_norm(params, self.grid), loss, *extra)
        self.last_norm = norm
        spike = self.suspect(norm, loss_f) if self.suspect is not None else None
        if self.scaler is not None:
            finite = math.isfinite(norm)
            if not finite:
                log.info("step %d: fp16 gradients overflowed (norm %s): update skipped, loss scale %g -> %g",
                         self.progress.step + 1, norm, self.scaler.get_scale(),
                         self.scaler.get_scale() * self.scaler.backoff_factor)
        else:
            finite = self.guard.finite_step(self.model, norm, loss_f, spike)
        if finite and small:  # before clipping; the fp16 loss scale taken out of the data groups' norms
            scale = self.scaler.get_scale() if self.scaler is not None else 1.0
            self.noise.update(small[0] / scale**2, norm * norm)  # type: ignore[union-attr]
        if finite:
            factor = clip_coefficient(norm, self.train.grad_clip)
            if factor < 1.0:
                self.clipped += 1
            scale_grads_(params, factor)
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:  # after the step: K-FAC reads the scale its captured gradients carry
            self.scaler.update(finite)
        return finite


def inject_nonfinite(pmodel: nn.Module, grid: Grid) -> None:
    """Test hook (``train.inject_nonfinite``): a NaN in one gradient after the sync, where a
    NaN from one rank's computation would leave it. The first spatially sharded weight's
    gradient, on the last spatial rank only (of every data group: the sync averaged it over
    the data group); without one, the first gradient on every rank (the sync's all-reduce
    spreads a NaN to every rank). A rank deciding from its own gradients alone would then
    disagree with the others."""
    params = [p for p in pmodel.parameters() if p.grad is not None]
    sharded = [p for p in params if getattr(p, "spatial_shard", False)]
    if sharded:
        if grid.spatial_rank == grid.spatial_size - 1:
            sharded[0].grad.view(-1)[0] = float("nan")  # type: ignore[union-attr]
    elif params:
        params[0].grad.view(-1)[0] = float("nan")  # type: ignore[union-attr]


def zero_loss(out: Any) -> torch.Tensor:
    """A loss of 0 that still reaches every parameter the output came from."""
    if isinstance(out, torch.Tensor):
        return out.sum() * 0.0
    if isinstance(out, (tuple, list)):
        return sum((zero_loss(o) for o in out), torch.zeros(()))
    if isinstance(out, dict):
        return sum((zero_loss(o) for o in out.values()), torch.zeros(()))
    return torch.zeros(())
