"""Peak memory as a user's program sees it: the serial model built, a global batch made,
``parallel.parallelize`` then ``parallel.scatter``, one forward and backward.

``parallel.bench.step.peak_memory`` measures the framework's own step (the block cloned
as a reader would give it, the weights sharded with ``input_shape``); this probe measures
the public API the way the README uses it, so that what the API itself costs (a global
batch kept alive by its block, a Flatten+Linear weight left whole) shows up in the ratio.
"""

from __future__ import annotations

import gc
from typing import Any, Sequence

import torch

import parallel
from parallel.runtime import memory
from parallel.bench.step import make_model
from parallel.grid import Grid
from parallel.job.family import get


def _program(grid: Grid, name: str, size: Sequence[int], overrides: Sequence[str], batch: int,
             input_shape: bool, channels_last: bool, marks: dict[str, float] | None) -> None:
    """The user's program; ``marks`` gets the resident memory after each stage."""
    model, in_shape = make_model(name, size, overrides)
    x = torch.randn((batch, *in_shape), generator=torch.Generator().manual_seed(1))
    if marks is not None:
        marks["model_and_batch"] = memory.in_use_bytes(grid.device)
    pmodel = parallel.parallelize(model, grid, input_shape=in_shape if input_shape else None,
                                  channels_last=channels_last)
    x = parallel.scatter(x, grid)  # the user's own name for the block: the global batch may go
    if marks is not None:
        gc.collect()
        marks["parallelized"] = memory.in_use_bytes(grid.device)
        memory.reset_peak(grid.device)
    out = pmodel(x)
    out.float().square().mean().backward()
    if marks is not None:
        marks["peak"] = memory.peak_held_bytes(grid.device)


def api_peak_memory(grid: Grid, name: str, size: Sequence[int], overrides: Sequence[str], batch: int,
                    input_shape: bool = False, channels_last: bool = False, warmup: bool = True) -> dict[str, Any]:
    """This rank's resident memory (bytes) at each stage of the user's program, above a
    baseline. ``warmup``: the baseline is taken after the same program ran once on a tiny
    model (what the first step of anything costs once is runtime, not this model's memory,
    as in ``peak_memory``). Without it the baseline is the rank as the program finds it
    (torch imported, the process group up): the growth a user sees from outside, the
    one-time costs of the first forward and backward (oneDNN's and gloo's buffers, the
    autograd engine's threads) included."""
    if warmup:
        _program(grid, name, [4 * g for g in grid.spatial], list(get(name).tiny_overrides), 1, input_shape,
                 channels_last, None)
    gc.collect()
    memory.reset_peak(grid.device)
    baseline = memory.in_use_bytes(grid.device)
    marks: dict[str, float] = {}
    _program(grid, name, size, overrides, batch, input_shape, channels_last, marks)
    return {"baseline_bytes": baseline, **{f"{k}_bytes": v - baseline for k, v in marks.items()},
            "forward_backward_growth_bytes": marks["peak"] - marks["parallelized"]}
