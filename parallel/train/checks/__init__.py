"""The checks of a job, in one pass: bad input stops the job with one clear message, up
front, and the split model is proven against its serial self before the first step.

``JobChecks`` runs the phases in their order, each once:

1. ``validate`` (``checks.config``): config values Hydra's types cannot check, before
   any file is read or any process group started;
2. ``samples`` (``checks.samples``, collective): the sample files of both splits, read
   once (``SampleFacts``), each rank a share;
3. ``fit`` (``checks.fit``): whether the network fits every volume it will see (crops,
   windows, whole cases) and the split, traced on the meta device;
4. ``verify`` (``checks.verify``): ``parallel.verify``, the split model against the
   serial one on a probe.

``lifecycle.train`` runs ``validate``; the ``Trainer`` the rest, in order. A phase called
out of order is a bug (``RuntimeError``). Every check raises ``InputError`` alike on
every rank (``checks.errors``): exit status 2, one message. See ``docs/failures.md``.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from parallel.grid import Grid
from parallel.model.parallel_module import ParallelModule
from parallel.train.checks import verify as split_check
from parallel.train.checks.config import check_world, is_auto, train_volume, validate_config, window
from parallel.job.errors import MAX_LISTED, ConfigError, InputError, quote_problems
from parallel.train.checks.fit import Strides, check_cases, check_model, meta_trace
from parallel.train.checks.samples import SampleFacts, check_data, read_facts
from parallel.job.config import JobConfig
from parallel.job.family import Family

__all__ = ["MAX_LISTED", "PHASES", "ConfigError", "InputError", "JobChecks", "SampleFacts", "Strides",
           "check_cases", "check_data", "check_model", "check_world", "is_auto", "quote_problems", "meta_trace",
           "read_facts", "train_volume", "validate_config", "window"]

PHASES = ("validate", "samples", "fit", "verify")
"""The phases of ``JobChecks``, in the order they run."""


class JobChecks:
    """One job's checks (see the module docstring); ``done`` lists the phases run so far."""

    def __init__(self, cfg: JobConfig, family: Family) -> None:
        self.cfg, self.family = cfg, family
        self.done: list[str] = []
        self.facts: SampleFacts | None = None
        self.volume: tuple[int, int, int] | None = None

    def _enter(self, phase: str) -> None:
        want = PHASES[len(self.done)] if len(self.done) < len(PHASES) else "nothing"
        if phase != want:
            raise RuntimeError(f"job checks: '{phase}' called after {self.done or 'none'}; the order is "
                               f"{' -> '.join(PHASES)}, each once")
        self.done.append(phase)

    def validate(self) -> None:
        """Phase 1: ``ConfigError`` naming the first key whose value cannot work."""
        self._enter("validate")
        validate_config(self.cfg)

    def read_facts(self) -> SampleFacts:
        """The ``SampleFacts`` before the process group starts (``parallel.spatial=auto``:
        rank 0 plans with them); read once, kept for ``samples``."""
        if self.facts is None:
            self.facts = read_facts(self.cfg, self.family)
        return self.facts

    def samples(self, grid: Grid) -> SampleFacts:
        """Phase 2 (collective): both splits' files checked; the job's ``SampleFacts``, with
        every case's shape."""
        self._enter("samples")
        self.facts = check_data(self.cfg, self.family, grid, self.facts)
        return self.facts

    def fit(self, grid: Grid) -> tuple[int, int, int]:
        """Phase 3: every crop, window and case against the network and the split; the
        volume the network trains on."""
        self._enter("fit")
        facts = self.facts
        assert facts is not None  # set by samples
        check_cases(self.cfg, self.family, grid, facts.channels, facts.train_shapes, facts.val_shapes)
        self.volume = train_volume(self.cfg, facts.volume)
        check_model(self.family, self.cfg.model, self.volume, facts.channels, grid, self.cfg.train)
        return self.volume

    def verify(self, model: nn.Module, parallelize: Callable[[], ParallelModule], grid: Grid) -> ParallelModule:
        """Phase 4 (collective): ``parallelize()`` converts the serial ``model``; the result
        checked against a copy of the serial network kept before (``parallel.verify``)."""
        self._enter("verify")
        assert self.facts is not None and self.volume is not None  # set by samples and fit
        serial = split_check.serial_copy(self.cfg, model, grid)  # before parallelize converts the model
        pmodel = parallelize()
        split_check.run(serial, pmodel, self.cfg, grid, self.volume, self.facts.channels)
        return pmodel
