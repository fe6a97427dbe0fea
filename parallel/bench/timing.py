"""Interleaved trials and medians: the load of other processes hits every variant alike."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping

import torch
from parallel import comm


def _barrier(group: object | None) -> None:
    comm.barrier(group, caller="bench.timing")


def interleaved(variants: Mapping[str, Callable[[], object]], trials: int, warmup: int = 1,
                group: object | None = None, cpu: bool = False,
                device: torch.device | None = None) -> dict[str, list[float]]:
    """Seconds of each variant per trial, variants run in turn within each trial.

    Under torch.distributed every rank runs the same schedule; a trial's time is the
    slowest rank's (one all-reduce of max per trial, outside the timed region). A variant
    that returns a dict of phase seconds (``{"forward": s, "backward": s}``) also gets
    ``name.phase`` entries; ``cpu`` adds ``name.cpu``, the process's CPU seconds (all its
    threads): on a loaded machine a steadier figure of the work done, though it leaves
    out time spent waiting for messages. The trial times are reduced on ``device``
    (default: the group's, ``comm.group_device``): NCCL takes only tensors on the GPU.
    """
    device = comm.group_device(group) if device is None else device
    for _ in range(warmup):
        for fn in variants.values():
            _barrier(group)
            fn()
    times: dict[str, list[float]] = {}
    for t in range(trials):
        names = list(variants) if t % 2 == 0 else list(reversed(variants))  # no fixed order bias
        keys, row = [], []
        for name in names:
            _barrier(group)
            c0 = time.process_time()
            t0 = time.perf_counter()
            phases = variants[name]()
            keys.append(name)
            row.append(time.perf_counter() - t0)
            if cpu:
                keys.append(f"{name}.cpu")
                row.append(time.process_time() - c0)
            if isinstance(phases, dict):
                for phase, secs in sorted(phases.items()):
                    keys.append(f"{name}.{phase}")
                    row.append(float(secs))
        secs = torch.tensor(row, dtype=torch.float64, device=device)
        comm.all_reduce_(secs, group, "max", caller="bench.timing.interleaved")
        for key, s in zip(keys, secs.tolist()):
            times.setdefault(key, []).append(s)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float]) -> list[float]:
    """The lowest, median and highest of ``xs`` (how far trials wandered)."""
    return [min(xs), statistics.median(xs), max(xs)] if xs else []


def ratio(num: list[float], den: list[float]) -> float:
    """Median of the per-trial ratios (paired trials cancel slow spells)."""
    return statistics.median(a / b for a, b in zip(num, den))


def load() -> list[float]:
    """The 1, 5 and 15 minute load averages (what else was running)."""
    import os

    return [round(v, 2) for v in os.getloadavg()]


def barrier_trials(fn: Callable[[], object], trials: int, device: torch.device, group: object | None = None,
                   reduce: str | None = None, caller: str = "bench.timing.barrier_trials") -> list[float]:
    """Seconds of ``trials`` calls of ``fn``, each started by a barrier of ``group`` (after
    one warm-up call, also barrier-started), timers synchronised with ``device``.
    ``reduce``: None (this rank's seconds), ``max`` (the slowest rank's) or ``mean``."""
    from parallel.bench import device as dev

    times = []
    for _ in range(trials + 1):
        comm.barrier(group, caller=caller)
        times.append(dev.seconds(fn, device))
    if reduce is None:
        return times[1:]
    t = torch.tensor(times[1:], dtype=torch.float64, device=device)
    comm.all_reduce_(t, group, "max" if reduce == "max" else "sum", caller=caller)
    if reduce == "mean":
        t /= comm.group_size(group)
    return t.tolist()
