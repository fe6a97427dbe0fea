#!/usr/bin/env python3
"""The performance targets of docs/performance.md from one ``scripts/perf_pass.sh`` pass.

    python scripts/perf_targets.py runs/perf_pass/<date>_<time>

Reads the summary lines of the pass's JSON files and prints a Markdown table: each figure,
its target, whether it is met, the command that measured it and the load averages around
it. Exit status 0 when every figure was found (met or not), 2 when one is missing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# (label, file, summary key or keys (the first found per summary line), goal, target, command)
TARGETS = [
    ("fair halo ratio, fwd+bwd, 64^3 x 32 ch, 3^3, split 2 along D", "layer", ["halo_fair_2x1x1"], "max", 1.05,
     "benchmark.py layer"),
    ("CosmoFlow 64^3 step, spatial 2 / serial", "step", ["cosmoflow_spatial2_over_serial"], "max", 0.55,
     "benchmark.py step --spatial 2x1x1"),
    ("memory per rank / serial, CosmoFlow 128^3 spatial 4, batch 1", "memory", ["spatial_4x1x1_over_serial"], "max",
     0.30, "benchmark.py memory --size 128 --splits 1x1x1,4x1x1 --batch 1"),
    ("memory per rank / serial, CosmoFlow 256^3 2x2x2, batch 1", "memory", ["spatial_2x2x2_over_serial"], "max", 0.15,
     "benchmark.py memory --size 256 --splits 1x1x1,2x2x2 --batch 1"),
    ("planner's worst step error after calibration, CosmoFlow (both 2-way grids)", "step",
     ["cosmoflow_worst_prediction_error"], "max", 0.15, "benchmark.py step --spatial 2x1x1 / 1x1x2"),
    ("planner's worst step error after calibration, U-Net (both 2-way grids)", "step",
     ["unet3d_worst_prediction_error"], "max", 0.15, "benchmark.py step --spatial 2x1x1 / 1x1x2"),
    ("256^3 uncompressed block reads / raw sequential read, warm, slowest of 2 / 4 / 2x2x2", "io",
     ["none_2x1x1_block_over_raw_warm", "none_4x1x1_block_over_raw_warm", "none_2x2x2_block_over_raw_warm"], "min", 0.5,
     "benchmark.py io --size 256"),
]


def summaries(out: Path, name: str) -> list[dict[str, Any]]:
    path = out / f"{name}.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("kind") == "summary"]


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[2].strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    out = Path(argv[0])
    missing = 0
    print("| figure | measured | target | met | command | load avg (1 min) before-after |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, name, keys, goal, target, command in TARGETS:
        values, loads = [], []
        for s in summaries(out, name):
            found = [s[k] for k in keys if s.get(k) is not None]
            if found:
                values.extend(found)
                loads.append(f"{s['load_before'][0]:.1f}-{s['load_after'][0]:.1f}")
        if not values:
            missing += 1
            print(f"| {label} | (not found) | {target} | | {command} | |")
            continue
        value = max(values) if goal == "max" else min(values)  # the worst of the pass
        met = value <= target if goal == "max" else value >= target
        sign = "<=" if goal == "max" else ">="
        print(f"| {label} | {value:.3f} | {sign} {target} | {'yes' if met else '**no**'} | `{command}` | "
              f"{', '.join(loads)} |")
    floors = [(s["spatial"], s[k]) for s in summaries(out, "step") for k in ("cosmoflow_floor2_over_serial",)
              if s.get(k) is not None]
    if floors:
        print("\nThe floor of the CosmoFlow step ratio on this machine (both ranks running the plain model "
              "on a block-sized volume at once, no communication), per grid: "
              + ", ".join(f"{'x'.join(map(str, sp))} {v:.3f}" for sp, v in floors))
    io = summaries(out, "io")
    if io:
        s = io[-1]
        print("\nOther codecs at 256^3, block reads / raw sequential read (warm), per split:\n")
        print("| codec | " + " | ".join(("2x1x1", "4x1x1", "2x2x2")) + " |")
        print("| --- | --- | --- | --- |")
        for codec in ("none", "gzip", "lz4", "zstd", "blosc2"):
            cells = [s.get(f"{codec}_{k}_block_over_raw_warm") for k in ("2x1x1", "4x1x1", "2x2x2")]
            if any(c is not None for c in cells):
                print(f"| {codec} | " + " | ".join("" if c is None else f"{c:.2f}" for c in cells) + " |")
    return 2 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
