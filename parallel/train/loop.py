"""Epochs of steps until the run ends: the training loop every model family shares.

``Loop`` receives the parts ``parallel.train.job`` built (the step, the readers, the
progress, the evaluation, the observers) and runs them; it logs, writes and counts
nothing itself: the observers do (``parallel.train.observe.events``). When the run ends
is decided in one place, ``Ending``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from parallel.data.loader import StepStats
from parallel.train.data import Batch, JobData, fixed_shapes
from parallel.train.evaluate import Evaluator, evaluation_due
from parallel.train.observe.events import Observer, RunClock, RunEnd
from parallel.train.observe.steptime import StepTimes
from parallel.train.persist.state import Progress
from parallel.train.stopsignal import StopRequest


@dataclass
class Ending:
    """When a run ends, and why: the loop asks ``leave_epoch`` after every step and ``why``
    before every epoch.

    ``total``: the run's steps (``train.epochs`` x steps per epoch, or ``train.max_steps``
    if fewer); ``reached(metric)``: whether a metric value reaches the target; ``signal``:
    the run's stop request (``run.stop_signal``).
    """

    total: int
    max_steps: int
    stop_at_target: bool
    reached: Callable[[float | None], bool]
    signal: StopRequest | None = None
    signalled: bool = False

    def leave_epoch(self, p: Progress) -> bool:
        """After a step: whether the epoch ends here (the run's last step, or a stop signal
        any rank received: a collective, so every rank leaves after the same step)."""
        if p.step >= self.total:
            return True
        self.signalled = self.signal is not None and self.signal.due()
        return self.signalled

    def why(self, p: Progress) -> str | None:
        """None while the run goes on; else why it ended: ``stopped_by_signal``, ``success``
        (the target reached: at an evaluation with ``train.stop_at_target``, or by the last
        step), ``max_steps`` (``train.max_steps``) or ``completed`` (``train.epochs``)."""
        if self.signalled:
            return "stopped_by_signal"
        if self.stop_at_target and self.reached(p.best):
            return "success"
        if p.step < self.total:
            return None
        if self.reached(p.best):
            return "success"
        return "max_steps" if self.max_steps and p.step >= self.max_steps else "completed"


@dataclass
class EvalSchedule:
    """When the loop evaluates: ``train.eval_every`` epochs from ``eval.start_epoch``, and
    after the last step with ``train.eval_at_end``."""

    every: int
    start_epoch: int = 0
    at_end: bool = True


class Loop:
    """One session of a run: ``fit`` trains until ``ending`` says the run ends.

    ``step(batch) -> loss`` is one optimiser step; ``global_batch``: samples per step;
    ``better(a, b)``: whether metric ``a`` beats ``b`` (the family's goal).
    """

    def __init__(self, step: Callable[[Batch], torch.Tensor], pmodel: Any, data: JobData, progress: Progress,
                 global_batch: int, evaluate: Evaluator, schedule: EvalSchedule, ending: Ending,
                 better: Callable[[float, float], bool], events: Observer, clock: RunClock,
                 times: StepTimes) -> None:
        self.step, self.pmodel, self.data, self.progress = step, pmodel, data, progress
        self.global_batch, self.evaluate, self.schedule, self.ending = global_batch, evaluate, schedule, ending
        self.better, self.events, self.clock, self.times = better, events, clock, times
        self.steps_per_epoch = len(data.train)
        self.train_seconds = 0.0  # this session's time in training steps (no evaluation)
        self.last_eval_step = -1

    def fit(self) -> RunEnd:
        """Train to the end the ``ending`` decides; why the run ended."""
        p = self.progress
        self.clock.start(p.run_s)
        self.events.run_start(p)
        while (why := self.ending.why(p)) is None:
            self._epoch()
        end = RunEnd(why, self.ending.reached(p.best))
        self.events.run_end(end)
        return end

    def _epoch(self) -> None:
        """The rest of the current epoch, its evaluation when due, and its end."""
        p, spe = self.progress, self.steps_per_epoch
        self.data.train.set_epoch(p.epoch, p.step - p.epoch * spe)
        self.events.epoch_start(p.epoch)
        t0 = time.perf_counter()
        for batch, stats in self.data.train:
            self._step(batch, stats)
            if self.ending.leave_epoch(p):
                break
        if self.ending.signalled:
            self.events.stopped(p)
            return
        self.train_seconds += time.perf_counter() - t0
        self.events.epoch_end(p.epoch)
        finished = p.step % spe == 0
        if finished:
            p.epoch += 1
        last = p.step >= self.ending.total
        if (finished and evaluation_due(p.epoch, self.schedule.every, self.schedule.start_epoch)) or \
                (last and self.schedule.at_end):
            self._evaluate()
        if finished or self.ending.why(p) is not None:
            self.events.epoch_done(p)

    def _step(self, batch: Batch, stats: StepStats) -> None:
        p = self.progress
        with self.times.step(stats.wait_seconds), fixed_shapes(self.pmodel, self.data):
            loss = self.step(batch)  # fixed shapes: no per-forward all-gather of block sizes
        p.step += 1
        p.samples += self.global_batch
        p.io.add(stats)
        self.events.step_end(p, loss, stats)

    def _evaluate(self) -> None:
        p = self.progress
        epoch_num = p.epoch if p.step % self.steps_per_epoch == 0 else p.epoch + 1
        self.events.eval_start(epoch_num)
        values = self.evaluate(p.epoch)
        metric = values[self.evaluate.metric_key]
        if p.best is None or self.better(metric, p.best):
            p.best = metric
        if p.reached_s is None and self.ending.reached(metric):
            p.reached_s = self.clock.now()
        values["elapsed_s"] = self.clock.now()
        self.last_eval_step = p.step
        self.events.evaluated(p, epoch_num, values)
