"""One optimiser step and its guard against non-finite numbers.

``TrainStep`` runs the augmentation, forward and backward over the accumulation
micro-batches, and the update (fp16 scaling, clipping). ``NonFiniteGuard`` applies the
two policies: samples whose input block is non-finite on any rank of the spatial group
are left out (``data.nonfinite=skip``); a step whose gradients (identical on every rank
after the sync) are non-finite stops the run (``train.nonfinite=fail``) or is skipped.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch
from parallel import comm
from torch import nn

from parallel.grid import Grid
from parallel.train.config import JobConfig
from parallel.train.data import Batch
from parallel.train.evaluate import autocast
from parallel.train.family import Family
from parallel.train.optim import Schedule
from parallel.train.state import Progress

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

    def finite_step(self, model: nn.Module, loss: torch.Tensor) -> bool:
        """Whether the step's gradients (identical on every rank after the sync) are finite.

        Non-finite: raise ``NonFiniteError`` (``fail``, or too many in a row) or drop the
        update and count it (``skip``).
        """
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        step = self.progress.step + 1
        if bool(torch.isfinite(norm)):
            self.bad_in_a_row = 0
            if not bool(torch.isfinite(loss)):
                log.warning("step %d: the loss is %s on this rank but the gradients are finite", step, float(loss))
            return True
        bad = next((n for n, p in model.named_parameters()
                    if p.grad is not None and not bool(torch.isfinite(p.grad).all())), "?")
        what = (f"step {step}: non-finite gradients (norm {float(norm)}, first in '{bad}'; "
                f"loss {float(loss):.6g} on this data group)")
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

    ``model`` is the serial model (its parameter names), ``pmodel`` its parallel form.
    """

    def __init__(self, cfg: JobConfig, family: Family, grid: Grid, model: nn.Module, pmodel: nn.Module,
                 optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, schedule: Schedule,
                 progress: Progress, guard: NonFiniteGuard) -> None:
        self.cfg, self.family, self.grid = cfg, family, grid
        self.model, self.pmodel, self.optimizer, self.scaler = model, pmodel, optimizer, scaler
        self.schedule, self.progress, self.guard = schedule, progress, guard
        self.lr = schedule.lr(progress.step)

    def __call__(self, batch: Batch) -> torch.Tensor:
        """One step on this rank's ``batch``; the local loss (zero for a skipped update)."""
        cfg, fam, grid = self.cfg, self.family, self.grid
        fields = batch.fields
        if fam.augment is not None:
            gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + self.progress.step)
            fields = fam.augment(fields, gen, grid, cfg)
        x, y = fields[fam.input_field], fields[fam.target_field]
        if batch.finite is not None:
            x, y = self.guard.drop_samples(x, y, batch.finite, grid)
        accum = cfg.train.accum_steps
        # tensor_split: always `accum` pieces (some may be empty after skipped samples),
        # so every rank runs the same collectives
        xs, ys = torch.tensor_split(x, accum), torch.tensor_split(y, accum)
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=grid.device)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            sync = contextlib.nullcontext() if i == accum - 1 else self.pmodel.no_sync()
            with sync:
                with autocast(cfg.train.precision, grid.device):
                    out = self.pmodel(xm)
                if len(ym):
                    loss = fam.loss(out, ym, grid) / accum
                else:  # nothing left to learn from: zero gradients, same collectives
                    loss = zero_loss(out)
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            total += loss.detach()
        self.lr = self.schedule.apply(self.optimizer, self.progress.step)
        if self.scaler is None and not self.guard.finite_step(self.model, total):
            self.optimizer.zero_grad(set_to_none=True)
            return torch.zeros((), device=grid.device)
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


def zero_loss(out: Any) -> torch.Tensor:
    """A loss of 0 that still reaches every parameter the output came from."""
    if isinstance(out, torch.Tensor):
        return out.sum() * 0.0
    if isinstance(out, (tuple, list)):
        return sum((zero_loss(o) for o in out), torch.zeros(()))
    if isinstance(out, dict):
        return sum((zero_loss(o) for o in out.values()), torch.zeros(()))
    return torch.zeros(())
