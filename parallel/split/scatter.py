"""Move between a global batch and this rank's part of it.

``scatter`` needs no communication: every rank holds the global batch and cuts out its
data group's rows and its spatial block. ``gather`` is collective: every rank gets the
whole global tensor; it is differentiable, and its backward is its adjoint (each rank's
block receives the sum over ranks of the gradient at that block).
"""

from __future__ import annotations

from typing import Any

import torch

from parallel import comm
from parallel.grid import Grid
from parallel.partition import block_bounds
from parallel.split import layout


def scatter(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """This rank's rows (its data group's share of dim 0) and spatial block of ``x``.

    ``x`` is (N, C, D, H, W), the same on every rank. Differentiable. A part of ``x`` is
    a copy, in ``x``'s layout (NCDHW or channels-last), not a view: a view would keep the
    whole global batch alive as long as the block lives (``x = scatter(x, grid)`` frees it).
    """
    if x.dim() != 5:
        raise ValueError(f"scatter expects a global batch (N, C, D, H, W), got shape {tuple(x.shape)}")
    r0, r1 = grid.batch_range(x.shape[0])
    sd, sh, sw = grid.block_slices(tuple(x.shape[2:]))
    part = x[r0:r1, :, sd, sh, sw]
    if part.numel() < x.numel():
        part = part.clone(memory_format=layout.memory_format(x))
    return part.to(grid.device)


def _global_shape(x: torch.Tensor, local: list[list[int]], grid: Grid) -> list[int]:
    """The global shape from every rank's local shape."""
    dims = x.dim()
    full = list(x.shape)
    full[0] = sum(local[d * grid.spatial_size][0] for d in range(grid.data_size))
    if dims == 5:
        for axis in range(3):
            full[axis + 2] = sum(local[grid.rank_at(tuple(i if a == axis else 0 for a in range(3)))][axis + 2]
                                 for i in range(grid.spatial[axis]))
    return full


def _regions(grid: Grid, full: list[int]) -> list[tuple[slice, ...]]:
    """Where each rank's part sits in the global tensor."""
    rows = block_bounds(full[0], grid.data_size)
    regions = []
    for rank in range(grid.world_size):
        r0, r1 = rows[rank // grid.spatial_size]
        index: tuple[slice, ...] = (slice(r0, r1),)
        if len(full) == 5:
            coords = grid.spatial_coords(rank % grid.spatial_size)
            index += (slice(None),) + grid.block_slices(full[2:], coords)
        regions.append(index)
    return regions


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        parts = comm.all_gather_varlen(x.contiguous(), grid.world_group)  # blocks may differ in size
        full = _global_shape(x, [list(p.shape) for p in parts], grid)
        regions = _regions(grid, full)
        fmt = layout.memory_format(x) if len(full) == 5 else torch.contiguous_format
        out = torch.empty(full, dtype=x.dtype, device=x.device, memory_format=fmt)  # the parts' layout
        for rank, part in enumerate(parts):
            out[regions[rank]] = part
        ctx.grid, ctx.region, ctx.fmt = grid, regions[grid.rank], fmt
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = comm.all_reduce_(grad.clone(memory_format=torch.contiguous_format), ctx.grid.world_group,
                                 caller="parallel.split.scatter.gather (backward)")
        return total[ctx.region].contiguous(memory_format=ctx.fmt), None


def gather(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """The global tensor, on every rank, from every rank's part.

    5-D parts are blocks of (N, C, D, H, W); parts with fewer dims are replicated over
    the spatial group and split over data groups along dim 0 (e.g. model outputs after
    Flatten+Linear).
    """
    if grid.world_size == 1:
        return x
    return _Gather.apply(x, grid)
