"""The I/O term against a shared file system of a stated aggregate bandwidth: predicted
time per epoch, whether the step waits for data, and which measure removes the wait.

A job of ``data`` x ``spatial`` ranks trains one sample per data group and step (the
global batch is the data groups, as ``parallel.bench.wall`` measures it). Per step the
shared file system delivers, to all ranks together:

- whole-sample reads: every rank of a spatial group reads the whole sample,
  ``data * spatial * sample`` bytes;
- block reads: each rank its block, ``data * sample`` bytes (a spatial group reads each
  sample once);
- a codec divides the stored sample by its ratio;
- staging reads the data set before the first epoch (today's staging: once per node
  that needs it, ``nodes * data set`` with a global shuffle; read-once staging: once,
  ``data set``), then nothing from the shared file system.

The reader works ahead of the compute (``data.workers``, ``data.prefetch``), so a step
takes ``max(compute, io)``; an epoch adds the one part that cannot overlap, ``min(compute,
io)`` (the first read before any compute, or the last compute after the last read). The shared file
system's rate is shared by every rank; ``rank_bandwidth`` (the ``Machine``'s
``io_bandwidth``: what one rank reads and decodes per second) caps each rank besides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class Measure:
    """One way to read: whole samples or blocks, a codec's ratio, staging."""

    name: str
    whole: bool = False
    ratio: float = 1.0
    """Stored bytes of a sample without the codec over with it (1: as given)."""
    staging: str | None = None
    """None (read the shared file system every epoch), ``each`` (today's staging: every
    node reads what it needs) or ``once`` (read-once staging)."""


def epoch_time(m: Measure, samples: int, sample_bytes: float, data: int, spatial: int, nodes: int,
               fs_bandwidth: float, compute_step_s: float, epochs: int = 1, batch: int | None = None,
               rank_bandwidth: float = math.inf, net_bandwidth: float = math.inf) -> dict[str, Any]:
    """Predicted seconds per epoch (staging spread over ``epochs``) and their parts.

    ``sample_bytes``: one sample as stored without a codec (the measure's ``ratio``
    divides it); ``compute_step_s``: one step's compute and communication without I/O;
    ``net_bandwidth``: bytes/s a node receives in read-once staging's exchange; ``batch``:
    the global batch (default: one sample per data group).
    """
    batch = batch or data
    steps = math.ceil(samples / batch)
    stored = sample_bytes / m.ratio
    per_rank = stored * batch / data * (1 if m.whole else 1 / spatial)  # bytes one rank reads per step
    staging_s = staging_bytes = 0.0
    if m.staging is None:
        shared = data * spatial * per_rank  # bytes all ranks read per step
        io_step = max(shared / fs_bandwidth, per_rank / rank_bandwidth)
        epoch = steps * max(compute_step_s, io_step) + min(compute_step_s, io_step)
        wait = max(0.0, io_step - compute_step_s)
        epoch_bytes = steps * shared
    else:
        if m.staging not in ("each", "once"):
            raise ValueError(f"staging {m.staging!r}: choose None, 'each' or 'once'")
        dataset = samples * stored
        staged = dataset * (nodes if m.staging == "each" else 1)
        staging_s = max(staged / fs_bandwidth, dataset / nodes / rank_bandwidth)
        if m.staging == "once" and nodes > 1:
            staging_s += dataset * (nodes - 1) / nodes / net_bandwidth
        io_step, wait, epoch_bytes = 0.0, 0.0, 0.0
        epoch = steps * compute_step_s
        staging_bytes = staged
    return {"measure": m.name, "epoch_s": epoch + staging_s / max(epochs, 1), "steady_epoch_s": epoch,
            "staging_s": staging_s, "io_step_s": io_step, "compute_step_s": compute_step_s,
            "wait_step_s": wait, "shared_bytes_per_epoch": epoch_bytes,
            "staging_bytes": staging_bytes}


def advice(measures: Sequence[Measure], baseline: Measure, **kw: Any) -> dict[str, Any]:
    """Whether ``baseline``'s step waits for data and, of ``measures``, the fastest per
    epoch and the ones that remove the wait: ``{"baseline": row, "rows": [...],
    "best": row, "removes_wait": [names]}``."""
    base = epoch_time(baseline, **kw)
    rows = [epoch_time(m, **kw) for m in measures]
    best = min(rows, key=lambda r: r["epoch_s"])
    return {"baseline": base, "rows": rows, "best": best,
            "removes_wait": [r["measure"] for r in rows if r["wait_step_s"] <= 1e-12]}


def describe(a: dict[str, Any], fs_bandwidth: float) -> list[str]:
    """Lines for people: the wait and what removes it."""
    base = a["baseline"]
    lines = []
    if base["wait_step_s"] > 1e-12:
        lines.append(f"at {fs_bandwidth / 1e9:.3g} GB/s shared, the step waits {base['wait_step_s']:.3f} s for data "
                     f"(reading {base['io_step_s']:.3f} s > compute {base['compute_step_s']:.3f} s): "
                     f"{base['epoch_s']:.1f} s per epoch with {base['measure']}")
    else:
        lines.append(f"at {fs_bandwidth / 1e9:.3g} GB/s shared, {base['measure']} keeps up "
                     f"(reading {base['io_step_s']:.3f} s <= compute {base['compute_step_s']:.3f} s per step)")
    best = a["best"]
    if base["wait_step_s"] > 1e-12:
        lines.append(f"  fastest: {best['measure']}, {best['epoch_s']:.1f} s per epoch "
                     f"({base['epoch_s'] / best['epoch_s']:.2f}x)"
                     + (f", staging {best['staging_s']:.1f} s once" if best["staging_s"] else ""))
        if a["removes_wait"]:
            lines.append(f"  no wait with: {', '.join(a['removes_wait'])}")
    return lines
