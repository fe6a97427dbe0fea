"""A suspicious step replayed once, to tell a transient fault from bad data or a bad model.

With ``train.replay=true``, every step's global gradient norm and this rank's loss are
gathered over the world before the update (one all-gather of three numbers). A step is
suspicious when any rank saw a non-finite norm, or one above ``train.spike_factor`` times
the running average of the steps before it (0: no spike test). Every rank then abandons
the step before anything is updated (the weights and the optimiser state are untouched:
the update has not run), puts back what the step's forward changed (the RNG streams, the
model's buffers such as BatchNorm's running statistics, the count of skipped samples)
and runs it again with the same batch:

- the same numbers on every rank, bit for bit: the data or the model (a bad sample, a
  learning rate too high). The step's samples are named, and the step goes on to the
  usual ``train.nonfinite`` policy (a spike counts as a non-finite step there);
- other numbers: a transient fault (a flipped bit in a gradient, a kernel gone wrong on
  one device). The ranks whose numbers changed are named, and training goes on with the
  replayed step.

What it costs: a copy of the model's buffers and the RNG streams per step (bytes to a few
MB: no copy of the weights or the optimiser state is needed, since the replay starts before
the update), the per-step all-gather, and, for a suspicious step, the step once more.
Not with K-FAC (its captured statistics would count twice) or fp16 (the loss scaler's
overflows are its own business): refused by the config check.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
from torch import nn

from parallel import comm
from parallel.grid import Grid
from parallel.train.data import Batch
from parallel.train.persist.rng import rng_state, set_rng_state
from parallel.train.persist.state import Progress
from parallel.train.step import TrainStep

log = logging.getLogger("parallel.train")

MAX_SAMPLES = 8  # samples named in a message


class _Abandon(Exception):
    """The step is suspicious: abandoned before its update, to be replayed."""


def _bits(x: float) -> tuple[bool, float]:
    """A float as compared between the two runs of a step: NaN equals NaN."""
    return (True, 0.0) if math.isnan(x) else (False, x)


class Replay:
    """``step(batch)``, replayed once when suspicious (see the module docstring);
    collective: every rank calls it alike. ``model``: the serial model (its buffers and
    dropout streams); ``train_batches``: the run's training ``Batches`` (to name a step's
    samples)."""

    def __init__(self, step: TrainStep, grid: Grid, model: nn.Module, progress: Progress, spike_factor: float,
                 train_batches: Any = None, steps_per_epoch: int = 1) -> None:
        self.step, self.grid, self.model, self.progress = step, grid, model, progress
        self.spike_factor, self.batches, self.steps_per_epoch = spike_factor, train_batches, steps_per_epoch
        self.average: float | None = None  # running average of the global gradient norm
        self.first: list[list[float]] | None = None
        self.replaying = False
        self.transient = 0  # steps replayed to other numbers this session
        self.persistent = 0
        self.steps = 0
        self.seconds = 0.0  # what watching cost the steps (the copies and the gather), replays aside
        step.suspect = self._judge

    def __call__(self, batch: Batch) -> torch.Tensor:
        t0 = time.perf_counter()
        saved = self._save()
        self.seconds += time.perf_counter() - t0
        self.steps += 1
        self.replaying, self.first = False, None
        try:
            return self.step(batch)
        except _Abandon:
            pass
        self._restore(saved)
        self.replaying = True
        try:
            return self.step(batch)
        finally:
            self.replaying = False

    # -- what a step's forward changes besides the update ----------------------------------
    def _save(self) -> tuple[torch.Tensor, list[torch.Tensor], int]:
        return (rng_state(self.model), [b.detach().clone() for b in self.step.pmodel.buffers()],
                self.progress.skipped_samples)

    def _restore(self, saved: tuple[torch.Tensor, list[torch.Tensor], int]) -> None:
        rng, buffers, skipped = saved
        set_rng_state(rng, self.model)
        with torch.no_grad():
            for b, v in zip(self.step.pmodel.buffers(), buffers):
                b.copy_(v)
        self.progress.skipped_samples = skipped

    # -- the judge, between the gradients and the update -----------------------------------
    def _gather(self, norm: float, loss: float, suspicious: bool) -> list[list[float]]:
        row = torch.tensor([norm, loss, float(suspicious)], dtype=torch.float64, device=self.grid.device)
        if self.grid.world_size == 1:
            return [row.tolist()]
        return [p.cpu().tolist() for p in comm.all_gather(row, self.grid.world_group, caller="replay.judge")]

    def _suspicious(self, norm: float) -> bool:
        if not math.isfinite(norm):
            return True
        return self.spike_factor > 0 and self.average is not None and norm > self.spike_factor * self.average

    def _judge(self, norm: float, loss: float) -> str | None:
        """Before the update of the step: abandon it (first run, suspicious), or, after its
        replay, say what it was (None: go on as usual; a reason: a bad finite step)."""
        t0 = time.perf_counter()
        table = self._gather(norm, loss, self._suspicious(norm))
        self.seconds += time.perf_counter() - t0
        step = self.progress.step + 1
        if not self.replaying:
            if any(r[2] for r in table):
                self.first = table
                log.warning("step %d: suspicious (%s); replaying it from the state before it with the same "
                            "batch", step, self._what(table))
                raise _Abandon
            self._average(table)
            return None
        first = self.first or table
        changed = [r for r, (a, b) in enumerate(zip(first, table)) if _bits(a[0]) != _bits(b[0]) or
                   _bits(a[1]) != _bits(b[1])]
        if changed:
            self.transient += 1
            log.warning("step %d: a transient fault on %s: the replay gave other numbers (first %s; replayed "
                        "%s); training goes on with the replayed step", step,
                        ", ".join(f"rank {r}" for r in changed), self._what(first, changed),
                        self._what(table, changed))
            if not any(r[2] for r in table):
                self._average(table)
            return None
        self.persistent += 1
        samples = self._samples()
        log.warning("step %d: the replay gave the same numbers on every rank (%s): the data or the model, not a "
                    "fault; the step's samples: %s", step, self._what(table), samples)
        if all(math.isfinite(r[0]) for r in table):  # a spike: a bad step for train.nonfinite
            return (f"gradient norm {table[0][0]:.6g} above train.spike_factor={self.spike_factor:g} x its running "
                    f"average {self.average:.6g}, the same when replayed (samples {samples})")
        return None  # non-finite: the guard says so

    def costs(self) -> dict[str, Any]:
        """The summary's ``replayed_steps``: the verdicts, and what watching cost each step."""
        return {"transient": self.transient, "persistent": self.persistent,
                "seconds_each_step": self.seconds / max(self.steps, 1)}

    def _average(self, table: list[list[float]]) -> None:
        norm = max(r[0] for r in table)  # the same on every rank (every rank gathered the same)
        self.average = norm if self.average is None else 0.9 * self.average + 0.1 * norm

    def _what(self, table: list[list[float]], ranks: list[int] | None = None) -> str:
        ranks = list(range(len(table))) if ranks is None else ranks
        norms = {table[r][0] for r in ranks}
        if len(norms) == 1 and len(ranks) > 1:
            return f"gradient norm {table[ranks[0]][0]:.6g} on every rank"
        return ", ".join(f"rank {r}: gradient norm {table[r][0]:.6g}" for r in ranks)

    def _samples(self) -> str:
        """The step's samples (every data group's), as files and rows where the sampler
        says its order; else the epoch and the step."""
        p, spe = self.progress, self.steps_per_epoch
        epoch, index = p.epoch, p.step - p.epoch * spe
        loader = getattr(self.batches, "loader", None)
        sampler, dataset = getattr(loader, "sampler", None), getattr(loader, "dataset", None)
        if sampler is None or dataset is None or not hasattr(sampler, "order"):
            return f"step {index} of epoch {epoch} in the sampler's order"
        g = sampler.global_batch
        rows = [int(i) for i in sampler.order(epoch)[index * g:(index + 1) * g]]
        named = []
        for i in rows[:MAX_SAMPLES]:
            path, row = dataset.locate(i)
            named.append(f"{path}[{row}]")
        more = f" (and {len(rows) - MAX_SAMPLES} more)" if len(rows) > MAX_SAMPLES else ""
        return ", ".join(named) + more
