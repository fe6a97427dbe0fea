"""This process's peak resident memory, read one way for the training report
(``parallel.train.observe.report``) and the benchmarks (``parallel.bench.device``); sizes such as
``3GiB`` in bytes (``parallel.memory_limit``, ``python -m parallel.plan --device-memory``)."""

from __future__ import annotations

import resource


def peak_rss_bytes() -> int:
    """Peak resident set size of this process: Linux's VmHWM (reset by ``5`` into
    ``/proc/self/clear_refs``); elsewhere ``ru_maxrss``, which would report the launcher's
    peak where that is larger, as it is inherited across exec."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux and BSD report KiB


def parse_bytes(text: str) -> float:
    """``80GB``, ``512MiB``, ``1e9`` -> bytes."""
    t = text.strip().upper()
    for suffix, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("TB", 1e12), ("GB", 1e9),
                         ("MB", 1e6), ("KB", 1e3), ("B", 1)):
        if t.endswith(suffix):
            return float(t[: -len(suffix)]) * mult
    return float(t)
