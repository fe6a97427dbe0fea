"""Sliding-window inference split across the spatial group.

Every rank holds its block of the kept part of a case (``parallel.infer.windows``: what
the MLPerf evaluation scores). For each window, in the reference's order, each rank
fetches its block of the window from the ranks that own those voxels (the halo module's
plans; voxels outside the case are the padding value), the spatially parallel model runs
on the window's blocks, and each rank's importance-weighted logits are summed back into
the owners of their voxels (the plans' adjoint). No rank ever holds a whole window or
the whole case; the result is this rank's block of
``sum(weights x logits) / sum(weights)``, whatever the split.

With one rank per group the same code is the serial sliding window (all copies local).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from parallel.infer.windows import PAD_VALUE, WindowPlan, coverage_1d, importance_factors
from parallel.partition import block_bounds
from parallel.split import halo

Forward = Callable[[torch.Tensor], torch.Tensor]


def _line(grid: Any, axis: int) -> tuple[list[int], int, int]:
    """Global ranks along a split dim through this rank, our position, and the parts."""
    if grid is None or grid.spatial[axis] == 1:
        return [0 if grid is None else grid.rank], 0, 1
    return grid.line_ranks(axis + 2), grid.coords[axis], grid.spatial[axis]


def _block(grid: Any, shape: Sequence[int]) -> list[tuple[int, int]]:
    if grid is None or grid.spatial_size == 1:
        return [(0, int(n)) for n in shape]
    return list(grid.block_range(shape))


def window_plans(plan: WindowPlan, grid: Any) -> list[list[halo.ExchangePlan]]:
    """Per dim, per window origin: the exchange that gives each rank its block of the
    window from the owners of the kept case's blocks (and its adjoint, back)."""
    out = []
    for axis in range(3):
        line, pos, parts = _line(grid, axis)
        before = plan.pad[axis][0]
        pieces = block_bounds(plan.window[axis], parts)
        out.append([halo.make_plan(plan.kept[axis], line, pos,
                                   [(s - before + a, s - before + b) for a, b in pieces])
                    for s in plan.starts[axis]])
    return out


@torch.no_grad()
def sliding_window_logits(forward: Forward, x: torch.Tensor, plan: WindowPlan, grid: Any = None,
                          pad_value: float = PAD_VALUE, sigma_scale: float = 0.125) -> torch.Tensor:
    """This rank's block of the averaged logits of the kept case (1, K, d, h, w).

    ``x``: this rank's block (1, C, d, h, w) of the kept case (global size ``plan.kept``);
    ``forward``: the spatially parallel model (block of a window in, block of its logits
    out). Collective over the spatial group: every rank of it calls with the same plan.
    Accumulates in float32, or float64 when the logits are.
    """
    if x.dim() != 5 or x.shape[0] != 1:
        raise ValueError(f"sliding_window_logits takes one case (1, C, D, H, W), got {tuple(x.shape)}")
    block = _block(grid, plan.kept)
    if tuple(x.shape[2:]) != tuple(b - a for a, b in block):
        raise ValueError(f"the block {tuple(x.shape[2:])} is not this rank's block {block} of the kept case {plan.kept}")
    plans = window_plans(plan, grid)
    factors = importance_factors(plan.window, sigma_scale)
    own = [block_bounds(plan.window[a], _line(grid, a)[2])[_line(grid, a)[1]] for a in range(3)]
    acc: torch.Tensor | None = None
    for origin in plan.origins():
        steps = [(a + 2, plans[a][plan.starts[a].index(o)]) for a, o in enumerate(origin)]
        window = halo.fetch_all(x, steps, fill=pad_value)
        logits = forward(window)
        dtype = torch.promote_types(logits.dtype, torch.float32)
        weight = _outer([f[a:b] for f, (a, b) in zip(factors, own)]).to(device=logits.device, dtype=dtype)
        part = halo.reduce_all(logits.to(dtype) * weight, steps)
        acc = part if acc is None else acc.add_(part)
    assert acc is not None
    norm = _outer([coverage_1d(plan, a, factors[a], lo, hi) for a, (lo, hi) in enumerate(block)])
    return acc / norm.to(device=acc.device, dtype=acc.dtype)


def _outer(v: Sequence[torch.Tensor]) -> torch.Tensor:
    return v[0][:, None, None] * v[1][None, :, None] * v[2][None, None, :]
