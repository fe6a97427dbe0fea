"""K-FAC's overhead per step against SGD (``scripts/benchmark.py step --optim kfac``).

K-FAC's steps are of three kinds: plain (precondition with the current eigenbases, then
SGD), factor-update steps (the forward and backward also capture the factors' parts, which
are then all-reduced) and inverse-update steps (a factor update, then the distributed
eigendecompositions and their broadcast). Each kind is timed on its own, interleaved with
SGD steps of the same model, and the average step follows from the intervals:

    average = plain + (factor - plain) / factor_interval + (inverse - factor) / inverse_interval

``parallel.plan``'s prediction of K-FAC's share (``parallel.plan.kfac``) is printed beside it.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Sequence

import torch

import parallel
from parallel.bench.shared import Rows, overrides_of, sizes
from parallel.bench.step import make_model
from parallel.bench.timing import interleaved, load, median
from parallel.grid import Grid
from parallel.kfac import KFAC, KFACConfig


def _kinds(cfg: KFACConfig) -> dict[str, int]:
    """A step index of each kind the intervals allow (plain: none when every step captures)."""
    kinds = {"inverse": 0}
    if cfg.inverse_interval > cfg.factor_interval:
        kinds["factor"] = cfg.factor_interval
    if cfg.factor_interval > 1:
        kinds["plain"] = 1
    return kinds


def kfac_times(grid: Grid, name: str, size: Sequence[int], overrides: Sequence[str], batch: int, trials: int,
               cfg: KFACConfig) -> dict[str, Any]:
    """Median and best seconds of an SGD step and of each kind of K-FAC step on ``grid``."""
    world = grid if grid.world_size > 1 else None
    gen = torch.Generator().manual_seed(1)
    _, in_shape = make_model(name, size, overrides)
    x = torch.randn((batch, *in_shape), generator=gen)
    x = parallel.scatter(x, grid).clone() if grid.world_size > 1 else x

    def build() -> Any:
        model, _ = make_model(name, size, overrides)
        return parallel.parallelize(model, grid)

    sgd_model, kfac_model = build(), build()
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=1e-4, momentum=0.9)
    kfac = KFAC(kfac_model, world, cfg, lr=1e-4, momentum=0.9)

    def sgd_step() -> None:
        sgd.zero_grad(set_to_none=True)
        sgd_model(x).float().square().mean().backward()
        sgd.step()

    def kfac_step(at: int) -> None:
        kfac.seek(at)
        kfac.zero_grad(set_to_none=True)
        kfac_model(x).float().square().mean().backward()
        kfac.step()

    kfac_step(0)  # the eigenbases exist before any step is timed
    variants = {"sgd": sgd_step, **{f"kfac_{k}": (lambda at=at: kfac_step(at)) for k, at in _kinds(cfg).items()}}
    times = interleaved(variants, trials, warmup=1, group=grid.world_group if grid.world_size > 1 else None)
    return {"seconds": {k: median(v) for k, v in times.items()}, "best_seconds": {k: min(v) for k, v in times.items()},
            "layers": len(kfac.layers)}


def average_step(t: dict[str, float], cfg: KFACConfig) -> float:
    """K-FAC's seconds per step over a whole inverse interval, from each kind's time."""
    inverse = t["kfac_inverse"]
    factor = t.get("kfac_factor", inverse)
    plain = t.get("kfac_plain", factor)
    return plain + (factor - plain) / cfg.factor_interval + (inverse - factor) / cfg.inverse_interval


def kfac_step(args: argparse.Namespace) -> Rows:
    """K-FAC against SGD per model on the 2-way split, measured and predicted."""
    from parallel.bench.ranks import run_ranks
    from parallel.plan import Machine, Options, build_model, predict, trace
    from parallel.plan.kfac import KFACPlan, kfac_config

    cfg = kfac_config(args.kfac)
    size = sizes(args.size)
    split = tuple(sizes(args.spatial))
    summary: dict[str, Any] = {"kind": "summary", "command": "step", "optim": "kfac", "spatial": list(split),
                               "factor_interval": cfg.factor_interval, "inverse_interval": cfg.inverse_interval,
                               "load_before": load()}
    machine = Machine.load(args.calibration)
    for name in args.models.split(","):
        over = overrides_of(args, name)
        r = run_ranks(math.prod(split), kfac_times, name, size, over, args.batch, args.trials, cfg,
                      spatial=split)[0]
        model, in_shape, stored = build_model(name, size, over)
        layers = trace(model, in_shape)
        opts = Options(global_batch=args.batch, stored_bytes_per_voxel=stored)
        plan = KFACPlan(model, in_shape, cfg)
        pred = predict(layers, machine, 1, split, Options(**{**opts.__dict__, "kfac": plan}))
        med, best = r["seconds"], r["best_seconds"]
        avg = average_step(med, cfg)
        row = {"kind": "kfac_step", "model": name, "size": size, "batch": args.batch, "set": over,
               "spatial": list(split), "layers_preconditioned": r["layers"], "measured_median_s": med,
               "measured_best_s": best, "kfac_average_step_s": avg, "kfac_over_sgd": avg / med["sgd"],
               **{f"{k}_over_sgd": v / med["sgd"] for k, v in med.items() if k != "sgd"},
               "predicted_kfac_s": pred["kfac_s"], "predicted_sgd_step_s": pred["step_s"] - pred["kfac_s"],
               "predicted_kfac_over_sgd": pred["step_s"] / max(pred["step_s"] - pred["kfac_s"], 1e-12),
               "predicted_kfac_memory_bytes": pred["kfac_memory_bytes"]}
        yield row
        summary[f"{name}_kfac_over_sgd"] = row["kfac_over_sgd"]
        summary[f"{name}_predicted_kfac_over_sgd"] = row["predicted_kfac_over_sgd"]
    summary["load_after"] = load()
    yield summary
