"""Where a step's time goes: the halo exchange and the gradient all-reduce, timed and named.

The communication code wraps its calls in ``region(kind)``: the halo exchange's batched
messages (``exchange``) and the wait for an exchange running in the background
(``parallel.split.halo.in_background``) as ``HALO``; the gradient all-reduce's launch and the
wait for it (``parallel.model.gradsync``) as ``ALLREDUCE``. Each region is

- a ``torch.profiler.record_function`` range (``parallel.halo_exchange``,
  ``parallel.halo_exchange_wait``, ``parallel.grad_allreduce``), so that a trace
  (``train.profile``) shows it by name, and
- when a ``StepClock`` is running (the training loop starts one around each step), time
  added to the step's total of its kind.

How it is timed, and why it adds up: on the CPU (gloo) every call blocks the thread that
makes it, so the host's monotonic clock around the call is the time the step spent in it,
waiting for the neighbour included; nothing is synchronised for the measurement. Only the
outermost region counts (no time is counted twice), and regions of an exchange overlapped
with computation (on the halo helper thread; on CUDA, queued on the side stream) do not
count: what the step loses to them is the wait for their result, a region of its own. So the regions are disjoint intervals
of the step, and their sum never exceeds it. On CUDA (NCCL) a call returns once queued, so
the host clock would see only the launch: there each region records a pair of CUDA events
on the current stream, and ``StepClock.stop`` reads their elapsed times once the step's
work is done (the step already waits for its gradient norm on the host). That counts the
stream time the region's copies and waits took: the exposed communication, not what NCCL
overlapped with other kernels.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator

import torch

HALO = "halo_exchange"
"""The halo exchange: messages to and from the neighbours, and waiting for them."""
ALLREDUCE = "grad_allreduce"
"""The gradient all-reduce over the grid (``parallel.model.gradsync``)."""
KINDS = (HALO, ALLREDUCE)

_local = threading.local()  # .background: this thread's regions overlap the step's (the halo thread)
_active: "StepClock | None" = None  # the clock of the step in progress (one per process: one training loop)


def mark_background_thread() -> None:
    """Called on a helper thread whose communication overlaps the step's: its regions are
    named in traces but not counted (the step counts its wait for their results)."""
    _local.background = True


@contextlib.contextmanager
def overlapped() -> Iterator[None]:
    """Inside, this thread's regions overlap the step's work (an exchange queued on a CUDA
    side stream by ``parallel.split.halo.in_background``): named, not counted."""
    before = getattr(_local, "background", False)
    _local.background = True
    try:
        yield
    finally:
        _local.background = before


class region:
    """``with region(HALO): ...``: a named profiler range, timed into the running ``StepClock``."""

    __slots__ = ("kind", "label", "_rf", "_clock", "_t0", "_ev")

    def __init__(self, kind: str, label: str | None = None) -> None:
        self.kind = kind
        self.label = label or f"parallel.{kind}"

    def __enter__(self) -> "region":
        self._rf = torch.profiler.record_function(self.label)
        self._rf.__enter__()
        clock = _active
        self._clock = None
        if clock is not None and clock.depth == 0 and not getattr(_local, "background", False):
            self._clock = clock
            clock.depth += 1
            if clock.cuda:
                self._ev = torch.cuda.Event(enable_timing=True)
                self._ev.record()
            else:
                self._t0 = time.monotonic()
        return self

    def __exit__(self, *exc: Any) -> None:
        clock = self._clock
        if clock is not None:
            clock.depth -= 1
            if clock.cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                clock.events.append((self.kind, self._ev, end))
            else:
                clock.totals[self.kind] += time.monotonic() - self._t0
        self._rf.__exit__(*exc)


def keep_out_of_compile() -> None:
    """Make Dynamo run the regions as they are instead of tracing them (``torch.compile``
    of a split model: ``parallel.model.compiled``). Traced, a region's clock reading became
    a guard on its value, and every call recompiled. Done on demand, not at import, since
    ``torch.compiler.disable`` imports Dynamo: a second of start-up for every process."""
    for name in ("__enter__", "__exit__"):
        fn = getattr(region, name)
        if not getattr(fn, "_parallel_kept_out", False):
            wrapped = torch.compiler.disable(fn)
            wrapped._parallel_kept_out = True  # type: ignore[attr-defined]
            setattr(region, name, wrapped)


class StepClock:
    """The communication time of one step at a time, by kind (``start``/``stop`` around it)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.depth = 0
        self.totals = dict.fromkeys(KINDS, 0.0)
        self.events: list[tuple[str, Any, Any]] = []

    def start(self) -> None:
        """From here on, regions on this process count into this step."""
        global _active
        self.totals = dict.fromkeys(KINDS, 0.0)
        self.events, self.depth = [], 0
        _active = self

    def stop(self) -> dict[str, float]:
        """End the step; seconds of each kind in it."""
        global _active
        _active = None
        for kind, begin, end in self.events:  # CUDA: the step's work is queued; wait for each region's end
            end.synchronize()
            self.totals[kind] += begin.elapsed_time(end) / 1000.0
        self.events = []
        return dict(self.totals)
