"""Step time with activations laid out channels-last (NDHWC) against the default NCDHW
(``scripts/benchmark.py step --channels-last``): serial and the 2-way split, interleaved."""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from parallel.bench.shared import Rows, overrides_of, sizes
from parallel.bench.step import Stepper, step_grids
from parallel.bench.timing import interleaved, load, median, ratio
from parallel.grid import Grid


def layout_times(grid: Grid, name: str, size: Sequence[int], overrides: Sequence[str], batch: int,
                 trials: int) -> dict[str, Any]:
    """Median step seconds of serial (rank 0 alone) and spatial 2, each NCDHW and NDHWC."""
    serial_grid, _ = step_grids(grid)
    steppers = {}
    for cl in (False, True):
        tag = "_channels_last" if cl else ""
        steppers["serial" + tag] = Stepper(serial_grid, name, size, overrides, batch, active=grid.rank == 0,
                                           channels_last=cl)
        steppers["spatial2" + tag] = Stepper(grid, name, size, overrides, batch, channels_last=cl)
    times = interleaved({k: s.step for k, s in steppers.items()}, trials, warmup=1, group=grid.world_group,
                        device=grid.device)
    out: dict[str, Any] = {"seconds": {k: median(v) for k, v in times.items()}}
    for base in ("serial", "spatial2"):
        out[f"{base}_channels_last_over_default"] = ratio(times[base + "_channels_last"], times[base])
    return out


def layout_step(args: argparse.Namespace) -> Rows:
    """``step --channels-last``: each model's step NDHWC over NCDHW, serial and split 2 ways."""
    from parallel.bench.ranks import run_ranks

    size = sizes(args.size)
    split = tuple(sizes(args.spatial))
    summary: dict[str, Any] = {"kind": "summary", "command": "step --channels-last", "load_before": load()}
    for name in args.models.split(","):
        r = run_ranks(2, layout_times, name, size, overrides_of(args, name), args.batch, args.trials,
                      spatial=split)[0]
        yield {"kind": "step_layout", "model": name, "size": size, "batch": args.batch, **r}
        for key in ("serial", "spatial2"):
            summary[f"{name}_{key}_channels_last_over_default"] = r[f"{key}_channels_last_over_default"]
    summary["load_after"] = load()
    yield summary
