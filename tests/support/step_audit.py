"""Count what a training step waits for: collectives and host reads (tests/ranks/test_step_audit.py).

``Audit`` wraps torch.distributed's communication functions (the ones ``parallel.comm``
calls: every collective of the framework goes through them) and, with a
``TorchFunctionMode``, the tensor methods that hand a value to Python (``item``,
``tolist``, ``__bool__``, ``__float__``, ``__int__``, ``__index__``, ``numpy``): on a GPU
each of those waits for the device. Each event is recorded with the code that caused it
(the first frame outside torch and ``parallel.comm``). The real functions run; nothing
is replaced.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

# isend/irecv are not wrapped: P2POp checks them by identity; the framework sends its
# point-to-point messages in batches (batch_isend_irecv), counted once per batch.
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "barrier", "batch_isend_irecv",
               "send", "recv", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "gather", "scatter",
               "monitored_barrier")
HOST_READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy"})


def caller() -> str:
    """``module.function`` of the first frame outside torch, this file and the plain
    collectives of parallel.comm (an autograd function's backward names itself)."""
    frame = sys._getframe(2)
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        skip = module.startswith(("torch", "parallel.comm.ops", "parallel.comm.checks", "contextlib"))
        if not (skip or module == __name__):  # parallel.comm.autograd's backward: the adjoint of a model sum
            return f"{module}.{frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


class _Reads(TorchFunctionMode):
    def __init__(self, events: list) -> None:
        super().__init__()
        self.events = events

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.events.append(("read", name, caller()))
        return func(*args, **(kwargs or {}))


class Audit:
    """Inside: every collective and host read is appended to ``events`` as (kind, name, caller)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []
        self._saved: dict[str, Callable] = {}
        self._reads = _Reads(self.events)

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.events.append(("collective", name, caller()))
            return fn(*args, **kwargs)
        return counted

    def __enter__(self) -> "Audit":
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        self._reads.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._reads.__exit__(*exc)
        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    def counts(self) -> dict[str, int]:
        """``"kind name <- caller": n`` for every event."""
        return dict(Counter(f"{k} {n} <- {c}" for k, n, c in self.events))


class AuditedStep:
    """A ``TrainStep`` whose every call is audited: ``per_step`` holds each call's counts."""

    def __init__(self, step: Callable[..., Any]) -> None:
        self.step = step
        self.per_step: list[dict[str, int]] = []

    def __getattr__(self, name: str) -> Any:  # lr, ... of the wrapped step
        return getattr(self.step, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with Audit() as audit:
            out = self.step(*args, **kwargs)
        self.per_step.append(audit.counts())
        return out
