"""The search: every (data x spatial) split of a device count that the model allows, ranked
by predicted step time; the fastest that fits in memory."""

from __future__ import annotations

from typing import Any

from parallel.plan.cost import Options, predict
from parallel.plan.local import valid
from parallel.plan.machine import Machine
from parallel.plan.trace import Layer


def splits(devices: int, layers: list[Layer], max_data: int | None = None) -> list[tuple[int, tuple[int, int, int]]]:
    """Every (data, (sd, sh, sw)) with data x sd x sh x sw = devices that the model allows."""
    out = []
    for d in range(1, devices + 1):
        if devices % d or (max_data is not None and d > max_data):
            continue
        s = devices // d
        for sd in range(1, s + 1):
            for sh in range(1, s // sd + 1):
                if s % (sd * sh):
                    continue
                sw = s // (sd * sh)
                if sd >= sh >= sw and valid(layers, (sd, sh, sw)):  # D first: contiguous slabs
                    out.append((d, (sd, sh, sw)))
    return out


def table(layers: list[Layer], machine: Machine, devices: int, memory_limit: float,
          opts: Options) -> list[dict[str, Any]]:
    """One row per split, fastest first; ``fits`` and ``best`` marked."""
    rows = []
    for d, sp in splits(devices, layers, max_data=opts.global_batch):
        p = predict(layers, machine, d, sp, opts)
        rows.append({"data": d, "spatial": list(sp), **p, "fits": p["memory_bytes"] <= memory_limit})
    rows.sort(key=lambda r: r["step_s"])
    for r in rows:
        r["best"] = False
    fitting = [r for r in rows if r["fits"]]
    if fitting:
        fitting[0]["best"] = True
    return rows


def choose(layers: list[Layer], machine: Machine, devices: int, memory_limit: float,
           opts: Options) -> tuple[int, int, int]:
    """The spatial split of the fastest row that fits (the smallest-memory row if none fits)."""
    rows = table(layers, machine, devices, memory_limit, opts)
    if not rows:
        raise ValueError(f"no (data x spatial) split of {devices} devices suits this model")
    best = next((r for r in rows if r["best"]), min(rows, key=lambda r: r["memory_bytes"]))
    return tuple(best["spatial"])  # type: ignore[return-value]

