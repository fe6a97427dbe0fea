"""``python -m parallel.plan --target``: (split, global batch) ranked by predicted time to
the quality target, with the data-parallel-only and the step-time-optimal choices beside."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from typing import Any

from parallel.model.trace import Layer
from parallel.plan.cost import Options, predict
from parallel.plan.machine import Machine
from parallel.plan.search import splits, table
from parallel.plan.target import StepsModel, rank


def target_rows(layers: list[Layer], machine: Machine, devices: int, memory_limit: float, opts: Options,
                model: StepsModel, batches: list[int] | None = None) -> list[dict[str, Any]]:
    """Every (split, global batch) of ``devices`` ranks: its predicted step time and memory
    (``predict``), the steps ``model`` predicts at its batch, and their product, ranked
    (``parallel.plan.target.rank``). ``batches``: the global batches to consider (each
    with the splits whose data size divides it); default: every split at 1, 2, 4 and 8
    samples per data group."""
    rows = []
    for d, sp in splits(devices, layers):
        for batch in (batches if batches is not None else [d * b for b in (1, 2, 4, 8)]):
            if batch % d:
                continue
            p = predict(layers, machine, d, sp, replace(opts, global_batch=batch))
            rows.append({"data": d, "spatial": list(sp), "global_batch": batch, **p,
                         "fits": p["memory_bytes"] <= memory_limit})
    return rank(rows, model)


def print_target_table(args: argparse.Namespace, layers: list[Layer], m: Machine, opts: Options,
                       memory_limit: float, size: list[int]) -> int:
    """The table of ``--target`` (or its JSON lines); exit status."""
    try:
        model = StepsModel.load(None if args.target == "default" else args.target)
        batches = [int(b) for b in args.batches.split(",")] if args.batches else None
    except (OSError, ValueError) as err:
        print(f"parallel.plan: {err}", file=sys.stderr)
        return 2
    rows = target_rows(layers, m, args.devices, memory_limit, opts, model, batches)
    if not rows:
        print(f"parallel.plan: no (split, global batch) of {args.devices} devices suits this model and "
              f"batches {batches}", file=sys.stderr)
        return 2
    # the step-time planner's choice at the job's batch (--batch, default: the devices)
    step_rows = table(layers, m, args.devices, memory_limit, opts)
    step_best = next((r for r in step_rows if r["best"]), None)
    step_choice = None
    if step_best is not None:
        step_choice = {**step_best, "global_batch": opts.global_batch, "steps": model.steps(opts.global_batch)}
        step_choice["time_to_target_s"] = step_choice["steps"] * step_best["step_s"]
    if args.json:
        for r in rows:
            print(json.dumps({**r, "machine": m.label, "b_noise": model.b_noise, "s_min": model.s_min}))
        return 0
    print(f"machine: {m.label}")
    print(f"{args.model} {'x'.join(map(str, size))}, {args.devices} devices, memory limit {args.device_memory} per "
          f"device; steps to the target S(B) = {model.s_min:.4g} (1 + {model.b_noise:.4g} / B)"
          + (f", in-run B_simple {model.b_simple:.4g}" if model.b_simple else "")
          + (f" [{model.source}]" if model.source else ""))
    print(f"learning-rate rule across batches: {model.lr_rule}")
    print(f"{'data':>5} {'spatial':>9} {'batch':>6} {'step s':>9} {'steps':>9} {'to target s':>12} "
          f"{'mem/rank GiB':>13}")
    shown = [r for r in rows if r["fits"]][:args.top] if args.top else rows
    for r in rows:
        if r not in shown and not (r["best"] or r["best_data_only"]):
            continue
        marks = [m for m, on in (("fastest to the target", r["best"]), ("data-parallel only", r["best_data_only"]),
                                 ("fastest step", step_choice is not None and _same(r, step_choice)))
                 if on]
        mark = ("<- " + ", ".join(marks)) if marks else ("" if r["fits"] else "(does not fit)")
        print(f"{r['data']:>5} {'x'.join(map(str, r['spatial'])):>9} {r['global_batch']:>6} {r['step_s']:>9.3f} "
              f"{r['steps']:>9.0f} {r['time_to_target_s']:>12.1f} {r['memory_bytes'] / 2**30:>13.2f}  {mark}")
    best = next((r for r in rows if r["best"]), None)
    plain = next((r for r in rows if r["best_data_only"]), None)
    if best is not None and plain is not None:
        print(f"the split buys {plain['time_to_target_s'] / best['time_to_target_s']:.2f}x in time to the target "
              f"over data parallelism alone ({_name(best)} against {_name(plain)})")
    if step_choice is not None and best is not None:
        ttt = step_choice["time_to_target_s"]
        print(f"the fastest step at batch {opts.global_batch} ({_name(step_choice)}) reaches the target in "
              f"{ttt:.1f} s: {ttt / best['time_to_target_s']:.2f}x the fastest to the target")
    return 0


def _same(r: dict[str, Any], choice: dict[str, Any]) -> bool:
    return (r["data"], r["spatial"], r["global_batch"]) == (choice["data"], choice["spatial"], choice["global_batch"])


def _name(r: dict[str, Any]) -> str:
    return f"data {r['data']} x spatial {'x'.join(map(str, r['spatial']))} at batch {r['global_batch']}"


def crossover(rows_by_devices: dict[int, list[dict[str, Any]]]) -> int | None:
    """The smallest device count whose fastest-to-the-target row that fits has a spatial split
    and beats the data-parallel-only one (None: never in these counts)."""
    for n in sorted(rows_by_devices):
        rows = rows_by_devices[n]
        best = next((r for r in rows if r["best"]), None)
        plain = next((r for r in rows if r["best_data_only"]), None)
        if best is not None and math.prod(best["spatial"]) > 1 and (
                plain is None or best["time_to_target_s"] < plain["time_to_target_s"]):
            return n
    return None
