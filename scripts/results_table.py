#!/usr/bin/env python3
"""The results table of docs/performance.md, generated from the committed result records.

    python scripts/results_table.py                                  # print the table
    python scripts/results_table.py --check docs/performance.md      # exit 1 if the doc's table differs
    python scripts/results_table.py --write docs/performance.md      # put the table into the doc
    python scripts/results_table.py --records runs/perf_pass/x       # from other records (a folder or files)

The records are the JSON lines ``scripts/benchmark.py ... --record FILE`` appends
(``parallel/bench/record.py``), by default every ``docs/results/*.jsonl``. ``ROWS`` names
the figures of the table: for each, the benchmark, the arguments that define the
quantity, the summary figure (or figures, of which the worst is shown) and the target
where one is set. A row shows the latest record that matches it exactly: a record whose
command changed anything else (a model override, another size) is another quantity and
does not match. The doc holds the table between ``<!-- results:begin -->`` and
``<!-- results:end -->``.

Exit status: 0 the table printed, written, or equal to the doc's; 1 the doc's table
differs (a diff is printed); 2 a malformed record, a missing file or missing markers.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from parallel.bench import record  # noqa: E402

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
NOT_DEFINING = {"trials", "repeat", "calibration", "no_weak", "models", "samples", "codecs"}
"""Arguments that change how precisely a figure is measured or which other figures run
beside it, not what the figure is: a record may differ from a row in these."""

WARM = "one-time runtime costs subtracted (baseline after a warm-up run on a tiny model)"
OUTSIDE = "from outside: growth of the resident set from before the program, one-time runtime costs included"


@dataclass(frozen=True)
class Row:
    label: str
    """What the figure is and what it includes."""
    benchmark: str
    case: dict[str, Any]
    """The arguments (argparse names) that define the quantity, with their values."""
    figures: tuple[str, ...]
    worst: str = "max"
    """Of several figures, the one shown: ``max`` or ``min``."""
    target: tuple[str, float] | None = None


STEP = {"size": "64", "batch": 2, "spatial": "2x1x1", "optim": "sgd", "overlap": "false", "channels_last": False,
        "device": "cpu"}
M128 = {"size": 128, "splits": "1x1x1,4x1x1", "batch": 1}
M256 = {"size": 256, "splits": "1x1x1,2x2x2", "batch": 1}
ROWS = [
    Row("halo overhead: split conv, forward+backward, its halo exchange included / the faster plain conv of the "
        "same block without communication (64^3 x 32 ch, 3^3, split 2 along D)", "layer",
        {"size": 64, "channels": 32, "kernel": 3, "batch": 1, "splits": "2x1x1"},
        ("halo_fair_2x1x1",), target=("<=", 1.05)),
    Row("CosmoFlow 64^3 training step (global batch 2, batch in memory), spatial 2 along D / serial", "step", STEP,
        ("cosmoflow_spatial2_over_serial",), target=("<=", 0.55)),
    Row("... its floor: both ranks running the plain model on a block-sized volume at once, no communication / "
        "serial", "step", STEP, ("cosmoflow_floor2_over_serial",)),
    Row("... data 2 (each rank one sample) / serial", "step", STEP, ("cosmoflow_data2_over_serial",)),
    Row("3D U-Net 64^3 training step (depth 3, 8 filters, global batch 2), spatial 2 along D / serial", "step", STEP,
        ("unet3d_spatial2_over_serial",)),
    Row("parallel.plan's step prediction against the median measured step, worst of serial, spatial 2, data 2 "
        "and weak 2-way, CosmoFlow (absolute error)", "step", STEP, ("cosmoflow_worst_prediction_error",),
        target=("<=", 0.15)),
    Row("... the same, U-Net", "step", STEP, ("unet3d_worst_prediction_error",), target=("<=", 0.15)),
    Row(f"peak memory per rank / serial's, the framework's training step, CosmoFlow 128^3 spatial 4x1x1, batch 1; "
        f"{WARM}", "memory", M128, ("spatial_4x1x1_over_serial",), target=("<=", 0.30)),
    Row(f"... a user's program through the public API (parallelize without input_shape, scatter, one forward and "
        f"backward), 128^3 spatial 4x1x1; {WARM}", "memory --api", {**M128, "api": True},
        ("spatial_4x1x1_peak_over_serial",), target=("<=", 0.30)),
    Row(f"... the same program, 128^3 spatial 4x1x1, {OUTSIDE}", "memory --api",
        {**M128, "api": True, "no_warmup": True}, ("spatial_4x1x1_peak_with_one_time_costs_over_serial",)),
    Row(f"peak memory per rank / serial's, the framework's training step, CosmoFlow 256^3 spatial 2x2x2, batch 1; "
        f"{WARM}", "memory", M256, ("spatial_2x2x2_over_serial",), target=("<=", 0.15)),
    Row(f"... a user's program through the public API, 256^3 spatial 2x2x2; {WARM}", "memory --api",
        {**M256, "api": True}, ("spatial_2x2x2_peak_over_serial",), target=("<=", 0.15)),
    Row(f"... the same program, 256^3 spatial 2x2x2, {OUTSIDE}", "memory --api",
        {**M256, "api": True, "no_warmup": True}, ("spatial_2x2x2_peak_with_one_time_costs_over_serial",)),
    Row("256^3 uncompressed HDF5 block reads / raw sequential reads of as many bytes, page cache warm, slowest of "
        "splits 2, 4 and 2x2x2", "io", {"size": "256", "spatial": "2,4,2x2x2"},
        ("none_2x1x1_block_over_raw_warm", "none_4x1x1_block_over_raw_warm", "none_2x2x2_block_over_raw_warm"),
        worst="min", target=(">=", 0.5)),
]


def load_records(paths: list[Path]) -> list[dict[str, Any]]:
    """Every record of ``paths`` (files, or folders of ``*.jsonl``), in file order."""
    out: list[dict[str, Any]] = []
    for p in paths:
        files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
        if not files or not all(f.is_file() for f in files):
            raise FileNotFoundError(f"{p}: no result records (*.jsonl) there")
        for f in files:
            out.extend(record.read(f))
    return out


def matches(row: Row, rec: dict[str, Any]) -> bool:
    """The record measured the row's quantity: the row's arguments have the row's values (at
    their defaults or given), and every other argument the record changed is one of
    ``NOT_DEFINING``."""
    if rec["benchmark"] != row.benchmark or not all(f in rec["figures"] for f in row.figures):
        return False
    other = [k for k in rec["case"] if k not in row.case and k not in NOT_DEFINING]
    return not other and all(rec["args"].get(k) == v for k, v in row.case.items())


def latest(row: Row, records: list[dict[str, Any]]) -> dict[str, Any] | None:
    found = [r for r in records if matches(row, r)]
    return max(found, key=lambda r: r["date"]) if found else None  # max keeps the first of equal dates


def _machine(m: dict[str, Any]) -> str:
    gpu = f", {m['gpus']} x {m['gpu']}" if m.get("gpu") else ""
    simd = f" ({m['simd']})" if m.get("simd") else ""
    return f"{m.get('cpu')}{simd}, {m.get('cores')} cores, {m.get('memory_gib')} GiB{gpu}, torch {m['torch']}"


def table(records: list[dict[str, Any]]) -> str:
    """The Markdown block that goes between the markers."""
    lines = ["| figure | measured | target | met | command | recorded (UTC), commit | load (1 min) before, after "
             "| machine |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    machines: list[str] = []
    absent = []
    for row in ROWS:
        rec = latest(row, records)
        if rec is None:
            absent.append(row.label)
            continue
        values = [rec["figures"][f] for f in row.figures]
        if not all(isinstance(v, (int, float)) for v in values):
            raise ValueError(f"{rec['_where']}: figures {row.figures} are not all numbers: {values}")
        value = max(values) if row.worst == "max" else min(values)
        met = ""
        if row.target is not None:
            sign, goal = row.target
            met = "yes" if (value <= goal if sign == "<=" else value >= goal) else "**no**"
        git = rec["git"]
        commit = f"{git.get('commit')}{' (dirty)' if git.get('dirty') else ''}"
        label = _machine({**rec["machine"], "torch": rec["torch"]})
        if label not in machines:
            machines.append(label)
        target = f"{row.target[0]} {row.target[1]}" if row.target else "-"
        loads = ", ".join(str(v[0]) if isinstance(v, list) and v else "?"
                          for v in (rec["load_before"], rec["load_after"]))
        lines.append(f"| {row.label} | {value:.3f} | {target} | {met} | `{rec['command']}` | "
                     f"{rec['date'][:16].replace('T', ' ')}, {commit} | {loads} | "
                     f"{chr(ord('A') + machines.index(label))} |")
    lines.append("")
    lines += [f"Machine {chr(ord('A') + i)}: {m}." for i, m in enumerate(machines)]
    if absent:
        lines += ["", "No current record (the snapshots hold earlier measurements): "
                  + "; ".join(absent) + "."]
    return "\n".join(lines)


def _between(text: str, doc: Path) -> tuple[int, int]:
    b, e = text.find(BEGIN), text.find(END)
    if b < 0 or e < b:
        raise ValueError(f"{doc}: no '{BEGIN}' ... '{END}' markers around the results table")
    return b + len(BEGIN), e


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=Path, nargs="+", default=[REPO / "docs" / "results"])
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--check", type=Path, metavar="DOC", help="compare DOC's table with the records")
    group.add_argument("--write", type=Path, metavar="DOC", help="replace DOC's table with the records'")
    args = ap.parse_args(argv)
    try:
        generated = table(load_records(args.records))
        doc = args.check or args.write
        if doc is None:
            print(generated)
            return 0
        text = doc.read_text(encoding="utf-8")
        b, e = _between(text, doc)
    except (OSError, ValueError, KeyError) as err:
        print(f"results_table: {err}", file=sys.stderr)
        return 2
    if args.write:
        doc.write_text(text[:b] + "\n" + generated + "\n" + text[e:], encoding="utf-8")
        return 0
    current = text[b:e].strip("\n")
    if current == generated:
        print(f"results_table: {doc}'s table matches the records ({len(ROWS)} rows checked)")
        return 0
    diff = difflib.unified_diff(current.splitlines(), generated.splitlines(), f"{doc} (the doc)",
                                "the records", lineterm="")
    print("\n".join(diff))
    print(f"results_table: {doc}'s table differs from the records; regenerate it with "
          f"python scripts/results_table.py --write {doc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
