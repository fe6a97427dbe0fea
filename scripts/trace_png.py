#!/usr/bin/env python3
"""Draw ``train.profile`` traces as one timeline picture (PNG), a band of lanes per rank.

    python scripts/trace_png.py runs/profiled/profile/rank0.json runs/profiled/profile/rank1.json --out trace.png

Each trace is a Chrome/Perfetto JSON that ``train.profile=N`` wrote
(``parallel.train.observe.profile``). Per rank, four lanes share one time axis: the recorded steps
(``ProfilerStep#k``), the computation (the outermost operators on the training thread:
the forward's and, under ``autograd::engine``, the backward's), the halo exchange
(``parallel.halo_exchange``, ``parallel.halo_exchange_wait``) and the gradient all-reduce
(``parallel.grad_allreduce``), from ``parallel.comm.timing``'s named regions. Ranks are
aligned on the host clock (the traces' ``baseTimeNanoseconds``), so a rank that waits
for its neighbour shows it. For the full detail open the JSON in https://ui.perfetto.dev.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

LANES = (("step", "#bbbbbb"), ("compute", "#4c72b0"), ("halo exchange", "#dd8452"), ("gradient all-reduce", "#55a868"))


def load(path: Path) -> tuple[float, list[dict[str, Any]]]:
    """(the trace's time base in microseconds, its complete events)."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    events = raw["traceEvents"] if isinstance(raw, dict) else raw
    base = float(raw.get("baseTimeNanoseconds", 0)) / 1e3 if isinstance(raw, dict) else 0.0
    return base, [e for e in events if e.get("ph") == "X" and "dur" in e]


def lanes(events: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """(start, duration) in microseconds of each lane's spans."""
    steps = [e for e in events if str(e["name"]).startswith("ProfilerStep#")]
    if not steps:
        raise SystemExit("no ProfilerStep#k event in the trace: was it written by train.profile?")
    main = steps[0]["tid"]
    out: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in LANES}
    out["step"] = [(e["ts"], e["dur"]) for e in steps]
    ops = sorted((e for e in events if e["tid"] == main and e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    end = -1.0
    for e in ops:  # the outermost operators: those that start after the previous outermost one ended
        if e["ts"] >= end:
            out["compute"].append((e["ts"], e["dur"]))
            end = e["ts"] + e["dur"]
    for e in events:
        name = str(e["name"])
        if name.startswith("parallel.halo_exchange"):
            out["halo exchange"].append((e["ts"], e["dur"]))
        elif name == "parallel.grad_allreduce":
            out["gradient all-reduce"].append((e["ts"], e["dur"]))
    # an operator that holds an exchange (a layer's backward) computes only outside it
    out["compute"] = _minus(out["compute"], out["halo exchange"] + out["gradient all-reduce"])
    return out


def _minus(spans: list[tuple[float, float]], cuts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``spans`` with the time of ``cuts`` taken out."""
    cuts = sorted(cuts)
    result = []
    for start, dur in spans:
        pieces = [(start, start + dur)]
        for c0, cd in cuts:
            c1 = c0 + cd
            pieces = [q for a, b in pieces for q in ((a, min(b, c0)), (max(a, c1), b)) if q[1] > q[0]]
        result += [(a, b - a) for a, b in pieces]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", type=Path, help="rank<r>.json files of one run")
    ap.add_argument("--out", type=Path, default=Path("trace.png"), help="the picture to write")
    ap.add_argument("--title", default=None, help="the picture's title (default: the traces' folder)")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for path in args.traces:
        base, events = load(path)
        runs.append((path, base, lanes(events)))
    t0 = min(base + start for _, base, ls in runs for start, _ in ls["step"])
    fig, ax = plt.subplots(figsize=(12, 1.0 + 1.1 * len(runs)))
    ticks, labels = [], []
    y = 0.0
    for path, base, ls in reversed(runs):
        for name, color in reversed(LANES):
            spans = [((base + s - t0) / 1e3, max(d / 1e3, 0.02)) for s, d in ls[name]]  # ms; hair-thin ones visible
            ax.broken_barh(spans, (y, 0.8), facecolors=color, edgecolors="white" if name == "step" else color,
                           linewidth=1.5 if name == "step" else 0)
            ticks.append(y + 0.4)
            labels.append(f"{path.stem}: {name}")
            y += 1.0
        y += 0.5
    ax.set_yticks(ticks, labels)
    ax.set_xlabel("time since the first recorded step began (ms)")
    ax.set_title(args.title or f"train.profile: {args.traces[0].parent}")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
