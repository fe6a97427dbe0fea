"""Interleaved trials and medians: the load of other processes hits every variant alike."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from parallel import comm


def _barrier(group: object | None) -> None:
    comm.barrier(group, caller="bench.timing")


def interleaved(variants: dict[str, Callable[[], None]], trials: int, warmup: int = 1,
                group: object | None = None) -> dict[str, list[float]]:
    """Seconds of each variant per trial, variants run in turn within each trial.

    Under torch.distributed every rank runs the same schedule; a trial's time is the
    slowest rank's (one all-reduce of max per trial, outside the timed region).
    """
    for _ in range(warmup):
        for fn in variants.values():
            _barrier(group)
            fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for t in range(trials):
        names = list(variants) if t % 2 == 0 else list(reversed(variants))  # no fixed order bias
        row = []
        for name in names:
            _barrier(group)
            t0 = time.perf_counter()
            variants[name]()
            row.append(time.perf_counter() - t0)
        secs = torch.tensor(row, dtype=torch.float64)
        comm.all_reduce_(secs, group, "max", caller="bench.timing.interleaved")
        for name, s in zip(names, secs.tolist()):
            times[name].append(s)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def ratio(num: list[float], den: list[float]) -> float:
    """Median of the per-trial ratios (paired trials cancel slow spells)."""
    return statistics.median(a / b for a, b in zip(num, den))


def load() -> list[float]:
    """The 1, 5 and 15 minute load averages (what else was running)."""
    import os

    return [round(v, 2) for v in os.getloadavg()]
