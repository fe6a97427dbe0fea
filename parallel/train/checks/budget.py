"""A memory budget per rank (``parallel.memory_limit``): checked before the first step
against the planner's predicted peak, and on CPUs held while the job runs.

Why: a sample too large for one device is the reason to split it, so a job should learn
that its grid cannot hold a sample before it builds anything, with the numbers, and a
rank that outgrows its share should stop with a message, not be shot by the kernel's OOM
killer (which leaves no word of which rank, or why).

- The budget: ``parallel.memory_limit`` (bytes or ``3GiB``), else the device's memory on
  GPUs; on CPUs nothing unless it is set.
- Before the first step (``start``, one call from ``lifecycle.train`` once the grid is up)
  rank 0 predicts this grid's peak per rank (``parallel.plan``, with this process's own
  resident memory as the runtime baseline on CPUs) and every rank stops alike with exit 2
  when it does not fit: the prediction, the budget, the smallest split that fits and what
  ``parallel.spatial=auto`` would choose among this job's ranks.
- On CPUs a thread reads this process's resident memory (``VmRSS``) every
  ``POLL_S`` seconds; a rank over the budget reports it through the watchdog (the
  failure path of every rank: the others stop naming it) and exits 2, or alone simply
  exits 2. Exit 2 as for other config errors: the same job with the same budget would
  fail again; raise the budget or split further.
- ``Budget.summary_fields`` puts the budget and the prediction beside the measured peaks
  in the run's summary.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from parallel.job.config import JobConfig
from parallel.job.errors import InputError
from parallel.runtime.memory import resident_bytes

log = logging.getLogger("parallel.train")

EXIT_OVER_BUDGET = 2
"""Exit status of a rank that goes over the budget while running (a config error: the budget)."""
POLL_S = 0.05
"""Seconds between two readings of a CPU rank's resident memory."""
GIB = 2**30
M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter: allocations from this many bytes up are mapped, not heaped."""


def size(nbytes: float) -> str:
    """``512 MiB`` or ``3.25 GiB``: the unit that keeps the figure readable."""
    return f"{nbytes / GIB:.2f} GiB" if abs(nbytes) >= GIB else f"{nbytes / 2**20:.1f} MiB"


def _map_large_allocations() -> None:
    """With a CPU budget, allocations of 1 MiB and more are mapped (glibc ``mallopt``), so a
    freed tensor goes back to the system at once: the resident memory the budget is held
    to then follows the live tensors, not the heap's high-water mark (by default glibc
    keeps freed blocks under its adaptive threshold, up to 32 MiB each, in the heap)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):  # not glibc: the budget holds all the same
        pass


class MemoryBudgetError(InputError):
    """The grid's predicted peak does not fit the budget (raised alike on every rank)."""


class MemoryBudgetExceeded(InputError):
    """A rank's resident memory went over the budget while running: this rank's own (not
    alike on every rank), exit 2 like the refusal before the first step."""

    collective = False


@dataclass
class Budget:
    """One job's budget, its prediction and (on CPUs) the thread that holds it."""

    limit: float
    source: str
    predicted: float | None
    rank: int
    peak: int = 0
    world: Any = None
    tripped: BaseException | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def summary_fields(self, peaks: Sequence[float]) -> dict[str, Any]:
        """The budget and the prediction beside every rank's measured peak (``peaks``:
        bytes), for the run's summary."""
        if self.tripped is not None:  # the watch is ending the job: the run did not end within its budget
            raise self.tripped
        out: dict[str, Any] = {"memory_limit_bytes": int(self.limit), "predicted_peak_memory_bytes": None}
        if self.predicted is None:
            return out
        out["predicted_peak_memory_bytes"] = int(self.predicted)
        out["peak_memory_over_predicted_per_rank"] = [round(float(p) / self.predicted, 4) for p in peaks]
        top = max(peaks) if len(peaks) else 0.0
        log.info("peak memory per rank: measured up to %.0f MiB, predicted %.0f MiB (%+.1f%%), budget %.0f MiB",
                 top / 2**20, self.predicted / 2**20, 100 * (top / self.predicted - 1), self.limit / 2**20)
        return out

    def stop(self) -> None:
        """Stop watching (the job ended; a later job in this process starts its own)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)


_ACTIVE: list[Budget] = []
"""The budget of the job running in this process (a process may run several jobs in turn:
a sweep, the test pool); ``start`` replaces it."""


def job_budget(memory_limit: Any, device: torch.device) -> tuple[float | None, str]:
    """(bytes, where they come from): ``parallel.memory_limit`` (``memory_limit``), else a
    GPU's memory, else None."""
    from parallel.train.checks.autosplit import memory_limit_bytes

    try:
        limit = memory_limit_bytes(memory_limit)
    except ValueError as err:
        raise InputError(str(err)) from None
    if limit is not None:
        return limit, f"parallel.memory_limit={memory_limit}"
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory), "the GPU's memory"
    return None, ""


def _decide(cfg: JobConfig, family: Any, grid: Any, facts: Any, limit: float, source: str) -> dict[str, Any]:
    """Rank 0's verdict: the predicted peak of this grid and, if over, the message."""
    from parallel import plan
    from parallel.train.checks.autosplit import job_plan

    layers, machine, opts = job_plan(cfg, family, facts, grid.local_size)
    spatial = tuple(grid.spatial)
    row = plan.predict(layers, machine, grid.data_size, spatial, opts)
    peak = row["memory_bytes"]
    verdict: dict[str, Any] = {"predicted": peak, "parts": [machine.baseline_memory, row["activation_bytes"]]}
    if peak <= limit:
        return verdict
    states = peak - machine.baseline_memory - row["activation_bytes"]
    rows = plan.table(layers, machine, grid.world_size, limit, opts)
    best = next((r for r in rows if r["best"]), None)
    auto = (f"; among these {grid.world_size} ranks parallel.spatial=auto would choose data {best['data']} x "
            f"spatial {'x'.join(map(str, best['spatial']))} ({size(best['memory_bytes'])})"
            if best is not None else f"; no split of these {grid.world_size} ranks fits")
    verdict["error"] = (
        f"the predicted peak memory per rank of data {grid.data_size} x spatial {list(spatial)} is "
        f"{size(peak)} (runtime {size(machine.baseline_memory)} + weights, gradients and optimiser "
        f"{size(states)} + activations {size(row['activation_bytes'])}), over the budget of "
        f"{size(limit)} ({source}); {plan.fit_hint(layers, machine, limit, opts, grid.data_size)}{auto}")
    return verdict


def start(cfg: JobConfig, family: Any, grid: Any, facts: Any, watchdog: Any = None) -> Budget | None:
    """Check this job's grid against its budget (``MemoryBudgetError`` on every rank if it
    does not fit) and, on CPUs, hold the budget while the job runs. Collective. ``cfg``:
    the job, as the planner predicts it; ``facts``: its ``SampleFacts``."""
    for old in _ACTIVE:
        old.stop()
    _ACTIVE.clear()
    limit, source = job_budget(cfg.parallel.memory_limit, grid.device)
    if limit is None:
        return None
    verdict: dict[str, Any] = {}
    if grid.rank == 0:
        try:
            verdict = _decide(cfg, family, grid, facts, limit, source)
        except InputError as err:  # the data's own error: the trainer's checks report it alike
            verdict = {"input_error": str(err)}
        except Exception as err:  # noqa: BLE001 - a network the planner cannot trace: run unchecked
            verdict = {"unplanned": f"{type(err).__name__}: {err}"}
    if grid.world_size > 1:
        from parallel import comm

        raw = comm.all_gather_bytes(json.dumps(verdict).encode(), grid.world_group, caller="budget.start")
        verdict = json.loads(raw[0].decode())
    if "input_error" in verdict:
        raise InputError(verdict["input_error"])
    if "error" in verdict:
        raise MemoryBudgetError(f"parallel.memory_limit: {verdict['error']}")
    predicted = verdict.get("predicted")
    if predicted is None:
        log.warning("memory budget %s (%s): no prediction to check it against (%s)", size(limit), source,
                    verdict.get("unplanned"))
    else:
        runtime, act = verdict["parts"]
        log.info("memory budget %s per rank (%s): predicted peak %s (%.0f%% of it: runtime %s, activations %s, "
                 "weights and optimiser %s)", size(limit), source, size(predicted), 100 * predicted / limit,
                 size(runtime), size(act), size(predicted - runtime - act))
    budget = Budget(limit, source, predicted, grid.rank, world=dist.group.WORLD if dist.is_initialized() else None)
    if grid.device.type == "cpu":
        _map_large_allocations()
        budget._thread = threading.Thread(target=_hold, args=(budget, budget.world, watchdog), daemon=True,
                                          name="memory-budget")
        budget._thread.start()
    _ACTIVE.append(budget)
    return budget


def _hold(budget: Budget, world: Any, watchdog: Any) -> None:
    """The CPU rank's watch: its resident memory against the budget until the job's process
    group goes (or ``stop``); over it, the job ends naming this rank, the budget and the peak."""
    while not budget._stop.wait(POLL_S):
        if world is not None and (not dist.is_initialized() or dist.group.WORLD is not world):
            return  # this job's process group is gone: its end (or failure) is under way
        rss = resident_bytes()
        budget.peak = max(budget.peak, rss)
        if rss <= budget.limit:
            continue
        predicted = size(budget.predicted) if budget.predicted is not None else "none"
        exc = MemoryBudgetExceeded(
            f"rank {budget.rank} went over its memory budget: resident {size(rss)} > {size(budget.limit)} "
            f"({budget.source}; predicted peak {predicted}); give it more memory per rank or split "
            "each sample further (parallel.spatial)")
        budget.tripped = exc  # a main thread reaching the summary meanwhile must not end cleanly
        if watchdog is not None:
            watchdog.fail(exc, own_error=True, code=EXIT_OVER_BUDGET)
        log.error("%s", exc)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for handler in logging.getLogger("parallel").handlers:
            handler.flush()
        time.sleep(0.1)
        os._exit(EXIT_OVER_BUDGET)
