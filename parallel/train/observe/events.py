"""The events of a run, and the observers that act on them.

The loop (``parallel.train.loop``) runs epochs of steps and says what happened; what a
run tells and keeps (the MLPerf log, metrics.jsonl and TensorBoard, the progress bar,
checkpoints, a profiler trace) observes those events instead of being woven into it.
Every rank sees every event, in the loop's order, and the observers in the order they
are listed: one that writes files does so on rank 0; one that takes part in a collective
(the loss mean of a log step, a checkpoint's RNG gather) does so on every rank alike.

A run's events::

    run_start
    (epoch_start, step_end*, epoch_end, [eval_start, evaluated], epoch_done)*
    stopped                 (a stop signal, after the step it came at: instead of epoch_end)
    run_end
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from parallel.data.loader import StepStats


class RunClock:
    """The run's seconds, continued across sessions: a resumed run starts from the seconds
    its checkpoint recorded."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def start(self, seconds_before: float) -> None:
        """Start now, as if ``seconds_before`` had already passed."""
        self._t0 = time.perf_counter() - seconds_before

    def now(self) -> float:
        """Run seconds so far."""
        return time.perf_counter() - self._t0


@dataclass(frozen=True)
class RunEnd:
    """Why and how a run ended, as the loop decided it."""

    why: str
    """``success``, ``max_steps``, ``completed`` or ``stopped_by_signal``."""
    reached: bool
    """Whether the best metric reached the target (MLPerf's ``success``; else ``aborted``)."""


class Observer:
    """Does nothing at every event; an observer overrides the events it acts on."""

    def run_start(self, progress: Any) -> None:
        """Before the first step of this session (``progress``: where the run stands)."""

    def epoch_start(self, epoch: int) -> None:
        """An epoch (0-based) starts or, on a resume, goes on."""

    def step_end(self, progress: Any, loss: torch.Tensor, stats: StepStats) -> None:
        """A step ended (``progress.step`` counts it); ``loss``: this rank's loss of the step."""

    def epoch_end(self, epoch: int) -> None:
        """The epoch's steps ran (the last one may be cut short by the run's end)."""

    def eval_start(self, epoch_num: int) -> None:
        """An evaluation starts after (1-based) epoch ``epoch_num``."""

    def evaluated(self, progress: Any, epoch_num: int, values: dict[str, Any]) -> None:
        """An evaluation ended with ``values`` (``val_loss``, the metric, ...); ``progress``
        holds the best metric so far."""

    def epoch_done(self, progress: Any) -> None:
        """An epoch and its evaluation are done, or the run's last step: a point to keep."""

    def stopped(self, progress: Any) -> None:
        """A stop signal ended the run after ``progress.step``."""

    def run_end(self, end: RunEnd) -> None:
        """The run ended (``end``: why); nothing runs after it."""


class Observers(Observer):
    """Several observers as one: each event goes to each, in order."""

    def __init__(self, observers: Sequence[Observer | None]) -> None:
        self.observers = [o for o in observers if o is not None]

    def _each(self, event: str, *args: Any) -> None:
        for o in self.observers:
            getattr(o, event)(*args)

    def run_start(self, progress: Any) -> None:
        self._each("run_start", progress)

    def epoch_start(self, epoch: int) -> None:
        self._each("epoch_start", epoch)

    def step_end(self, progress: Any, loss: torch.Tensor, stats: StepStats) -> None:
        self._each("step_end", progress, loss, stats)

    def epoch_end(self, epoch: int) -> None:
        self._each("epoch_end", epoch)

    def eval_start(self, epoch_num: int) -> None:
        self._each("eval_start", epoch_num)

    def evaluated(self, progress: Any, epoch_num: int, values: dict[str, Any]) -> None:
        self._each("evaluated", progress, epoch_num, values)

    def epoch_done(self, progress: Any) -> None:
        self._each("epoch_done", progress)

    def stopped(self, progress: Any) -> None:
        self._each("stopped", progress)

    def run_end(self, end: RunEnd) -> None:
        self._each("run_end", end)
