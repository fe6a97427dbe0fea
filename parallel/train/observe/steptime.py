"""Each training step's time, split into compute, halo exchange, gradient all-reduce and data waiting.

``StepTimes.step(data_wait_s)`` is held around one ``TrainStep`` call. The step's time is
the wait for its batch (the loader's ``StepStats.wait_seconds``) plus the wall time of the
call; within the call ``parallel.comm.timing`` counts the halo exchange (the messages and
the waits for neighbours, the wait for an exchange overlapped in the background) and the
gradient all-reduce (its launches and the wait for it at the end of the backward). Compute
is the rest: forward and backward kernels, the loss, the optimiser, and the smaller
collectives (normalisation statistics, the loss and gradient-norm sums). The measured
parts are disjoint intervals of the step (``parallel.comm.timing`` says why), so the four
add up to the step.

The summary reports each rank's mean per step over this session's steps after the first
(its warm-up: first-touch allocations, plans; with a single step, that one);
TensorBoard and ``metrics.jsonl`` get rank 0's means since the previous log step
(``train/time_*``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import torch

from parallel.comm.timing import ALLREDUCE, HALO, StepClock

PARTS = ("step_s", "compute_s", "halo_exchange_s", "grad_allreduce_s", "data_wait_s")
"""The figures of a step, in seconds: the whole, then its four parts."""


class StepTimes:
    """This rank's step times: the session's totals and those since the last log step."""

    def __init__(self, device: torch.device) -> None:
        self.clock = StepClock(device)
        self.first: list[float] | None = None          # the session's first step (its warm-up)
        self.totals = [0.0] * len(PARTS)               # the session's later steps
        self.n = 0
        self.since_log = [0.0] * len(PARTS)
        self.n_since_log = 0

    @contextlib.contextmanager
    def step(self, data_wait_s: float) -> Iterator[None]:
        """Time the step run inside (its batch took ``data_wait_s`` to arrive)."""
        t0 = time.perf_counter()
        self.clock.start()
        try:
            yield
        finally:
            comm = self.clock.stop()
        wall = time.perf_counter() - t0
        step = wall + data_wait_s
        # compute is what the step did besides communicating (>= 0 on the CPU by construction;
        # CUDA events may round a hair past the host's clock)
        compute = max(wall - comm[HALO] - comm[ALLREDUCE], 0.0)
        row = [step, compute, comm[HALO], comm[ALLREDUCE], data_wait_s]
        if self.first is None:
            self.first = row
        else:
            self.totals = [a + b for a, b in zip(self.totals, row)]
            self.n += 1
        self.since_log = [a + b for a, b in zip(self.since_log, row)]
        self.n_since_log += 1

    def log_values(self) -> dict[str, float]:
        """Mean seconds per step since the last call (``train/time_*`` in TensorBoard)."""
        n = max(self.n_since_log, 1)
        values = {f"time_{name}": total / n for name, total in zip(PARTS, self.since_log)}
        self.since_log, self.n_since_log = [0.0] * len(PARTS), 0
        return values

    def session_means(self) -> list[float]:
        """[steps counted, 1 if the first step was left out, mean seconds of each of ``PARTS``]
        of this session, for the summary."""
        if self.n:
            return [float(self.n), 1.0, *(t / self.n for t in self.totals)]
        if self.first is not None:
            return [1.0, 0.0, *self.first]
        return [0.0] * (2 + len(PARTS))


def summary_fields(per_rank: torch.Tensor) -> dict[str, Any]:
    """The summary's ``step_time``: each rank's mean seconds per step of each part
    (``per_rank``: every rank's ``session_means``), and their mean over the ranks."""
    if per_rank.numel() == 0 or float(per_rank[:, 0].max()) == 0:
        return {}
    out: dict[str, Any] = {"steps_counted": int(per_rank[0, 0]), "first_step_left_out": bool(per_rank[0, 1])}
    out["per_rank"] = {name: [round(float(v), 6) for v in per_rank[:, 2 + j].tolist()]
                       for j, name in enumerate(PARTS)}
    out["mean"] = {name: round(float(per_rank[:, 2 + j].mean()), 6) for j, name in enumerate(PARTS)}
    return {"step_time": out}


def format_line(summary: dict[str, Any]) -> str | None:
    """The summary's line for the breakdown (None without one)."""
    st = summary.get("step_time")
    if not st:
        return None
    m = st["mean"]
    step = m["step_s"]

    def part(name: str, what: str) -> str:
        share = 100.0 * m[name] / step if step > 0 else 0.0
        return f"{what} {m[name] * 1e3:.1f} ms ({share:.0f}%)"

    which = "after the first" if st["first_step_left_out"] else "all"
    slowest_halo = max(st["per_rank"]["halo_exchange_s"])
    return (f"time per step (mean of ranks, {st['steps_counted']} steps, {which}): {step * 1e3:.1f} ms = "
            f"{part('compute_s', 'compute')} + {part('halo_exchange_s', 'halo exchange and waiting')} "
            f"(max rank {slowest_halo * 1e3:.1f} ms) + {part('grad_allreduce_s', 'gradient all-reduce')} + "
            f"{part('data_wait_s', 'data waiting')}")
