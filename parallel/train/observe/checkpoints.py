"""Checkpoints as an observer of the run: written every ``run.checkpoint_every`` steps or
``run.checkpoint_every_s`` seconds (rank 0's clock decides for every rank), at the end of
every epoch (after its evaluation) and of the run, and after the step at which a stop
signal came; the last one is on disk before the run counts as ended. Each is written in
the background (``parallel.train.persist.writer``) from a copy taken at the step boundary.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

from torch import nn

from parallel.grid import Grid
from parallel.job.config import RunConfig
from parallel.train.observe.events import Observer, RunClock, RunEnd
from parallel.train.persist.state import TrainState
from parallel.train.persist.writer import Writer, wall_due

log = logging.getLogger("parallel.train")


class Checkpoints(Observer):
    """Saves ``state`` to ``path`` when due (see the module docstring); collective: every
    rank calls each save. ``saved_step``: the step of the last checkpoint (a resumed run's
    to start with); ``stop_signal``: the signal's name, for the message of a stop."""

    def __init__(self, writer: Writer, path: Path, grid: Grid, state: TrainState, model: nn.Module,
                 run: RunConfig, clock: RunClock, total_steps: int, saved_step: int | None = None,
                 stop_signal: str | None = None) -> None:
        self.writer, self.path, self.grid, self.state, self.model = writer, path, grid, state, model
        self.run, self.clock, self.total, self.stop_signal = run, clock, total_steps, stop_signal
        self.saved_step = saved_step
        self._saved_t = time.perf_counter()
        self.record: Callable[[Any], dict[str, Any]] | None = None
        """Run before each save (the replica check, ``parallel.train.replicas``): what the
        checkpoint records under ``replicas``; it may raise instead, and nothing is written."""

    def save(self, progress: Any) -> None:
        """Write the state now (the run's seconds so far recorded in it)."""
        progress.run_s = self.clock.now()
        checked = self.record(progress) if self.record is not None else None
        state = self.state.state_dict(self.grid)
        if checked is not None:
            state["replicas"] = checked
        self.writer.save(self.path, self.grid, state, self.model, keep=self.run.keep_checkpoints)
        self.saved_step = progress.step
        self._saved_t = time.perf_counter()

    def last_good(self) -> str:
        """Which checkpoint a run stopped for non-finite numbers can resume from."""
        self.writer.wait()  # the one being written is complete before it is named
        return (f"the last good checkpoint is {self.path} (step {self.saved_step})"
                if self.saved_step is not None else "no checkpoint was written yet")

    def _due(self, step: int) -> bool:
        """``run.checkpoint_every`` steps, or ``run.checkpoint_every_s`` seconds (rank 0's clock), passed."""
        if self.run.checkpoint_every and step % self.run.checkpoint_every == 0:
            return True
        return self.run.checkpoint_every_s > 0 and wall_due(self.grid, self._saved_t, self.run.checkpoint_every_s)

    # -- the run's events --------------------------------------------------------------
    def step_end(self, progress: Any, loss: Any, stats: Any) -> None:
        if self._due(progress.step):
            self.save(progress)

    def epoch_done(self, progress: Any) -> None:
        self.save(progress)

    def stopped(self, progress: Any) -> None:
        self.save(progress)  # as a checkpoint_every save: a resume goes on from here
        log.warning("run.stop_signal %s: stopped after step %d of %d; checkpoint %s; resume with "
                    "train.resume=true", self.stop_signal, progress.step, self.total, self.path)

    def run_end(self, end: RunEnd) -> None:
        self.writer.finish(self.grid)  # the last checkpoint is on disk before the run counts as ended
