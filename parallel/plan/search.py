"""The search: every (data x spatial) split of a device count that the model allows, ranked
by predicted step time; the fastest that fits in memory."""

from __future__ import annotations

from typing import Any

from parallel.model.trace import Layer
from parallel.plan.cost import Options, predict
from parallel.plan.local import valid
from parallel.plan.machine import Machine


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
    # Splits that all wait for the shared file system tie: the one computing fastest first.
    rows.sort(key=lambda r: (round(r["step_s"], 9), r["step_s"] - r.get("io_wait_s", 0.0)))
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


def smallest_fit(layers: list[Layer], machine: Machine, memory_limit: float, opts: Options, data: int = 1,
                 max_ranks: int = 1024) -> dict[str, Any] | None:
    """The spatial split with the fewest ranks per sample (the least memory among those)
    whose predicted peak per rank fits ``memory_limit``, at ``data`` data groups (the local
    batch stays the job's); None if none up to ``max_ranks`` ranks per sample does."""
    for s in range(1, max_ranks + 1):
        rows = []
        for sd in range(1, s + 1):
            for sh in range(1, s // sd + 1):
                if s % (sd * sh) or not sd >= sh >= s // (sd * sh):
                    continue
                sp = (sd, sh, s // (sd * sh))
                if valid(layers, sp):
                    rows.append({"data": data, "spatial": list(sp), **predict(layers, machine, data, sp, opts)})
        fitting = [r for r in rows if r["memory_bytes"] <= memory_limit]
        if fitting:
            return min(fitting, key=lambda r: r["memory_bytes"])
    return None


def fit_hint(layers: list[Layer], machine: Machine, memory_limit: float, opts: Options, data: int = 1,
             max_ranks: int = 1024) -> str:
    """One sentence naming ``smallest_fit``'s split and its predicted peak, for messages."""
    row = smallest_fit(layers, machine, memory_limit, opts, data, max_ranks)
    if row is None:
        return f"no spatial split of up to {max_ranks} ranks per sample fits"
    s = row["spatial"]
    return (f"the smallest split that fits is parallel.spatial=[{s[0]},{s[1]},{s[2]}] "
            f"({s[0] * s[1] * s[2]} ranks per sample, x {data} data groups): predicted "
            f"{row['memory_bytes'] / 2**20:.0f} MiB per rank")
