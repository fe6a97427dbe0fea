"""Collectives as autograd functions, with the gradient convention of the framework.

The convention that makes every parameter gradient a *partial sum* (so one sum over the
spatial group and a mean over the data group give the serial gradient):

- Values that differ per rank (blocks, partial products) flow through exact adjoints:
  ``all_reduce_sum`` sums in the forward and sums the gradients in the backward.
- A value that every rank of a spatial group then uses identically (replicated) counts
  once: ``replicated_grad`` scales its gradient by 1/S where it leaves the model, and
  ``spatial_sum`` (for losses and metrics) reduces with an identity backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from parallel.grid import Grid


def _group_size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None else 1


class _AllReduceSum(torch.autograd.Function):
    """y = sum over the group of x; the adjoint sums the gradients the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        y = x.clone()
        if _group_size(group) > 1:
            dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = grad.clone()
        if _group_size(ctx.group) > 1:
            dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceToReplicated(torch.autograd.Function):
    """Sum over the group; the result is used identically on every rank, so the
    gradient each rank receives is already the full one and passes through unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        y = x.clone()
        if _group_size(group) > 1:
            dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def all_reduce_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Differentiable sum over ``group`` whose backward is its exact adjoint."""
    return _AllReduceSum.apply(x, group)


def spatial_sum(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Sum partial sums (e.g. of a loss or a Dice term) over the spatial group.

    The result is the same on every rank of the group and is treated as replicated: use
    it to build the loss or metric, and ``loss.backward()`` gives each rank the gradient
    of its own voxels' share. Never a gather of the volume.
    """
    return _ReduceToReplicated.apply(x, grid.spatial_group if grid.spatial_size > 1 else None)


def replicated_grad(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Mark ``x`` as computed identically on every rank of the spatial group.

    Each rank's backward from a loss on ``x`` then carries 1/S of the gradient, so the
    spatial sum of parameter gradients counts the replicated computation once.
    """
    if grid.spatial_size == 1:
        return x
    return _ScaleGrad.apply(x, 1.0 / grid.spatial_size)


# -- non-autograd helpers (superseded by the comm layer at merge)
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce_(t: torch.Tensor, group: Any, op: str = "sum") -> torch.Tensor:
    """Reduce ``t`` in place over ``group`` (op: sum, avg, max or min); returns ``t``."""
    if op not in ("sum", "avg", "max", "min"):
        raise ValueError(f"all_reduce_: op must be sum, avg, max or min, got {op!r}")
    size = _group_size(group)
    if size > 1:
        dist.all_reduce(t, op=_REDUCE_OPS["sum" if op == "avg" else op], group=group)
        if op == "avg":
            t.div_(size)
    return t


def broadcast_(t: torch.Tensor, src: int, group: Any) -> torch.Tensor:
    """Overwrite ``t`` in place with global rank ``src``'s copy, over ``group``; returns ``t``."""
    if _group_size(group) > 1:
        dist.broadcast(t, src=src, group=group)
    return t


def barrier(group: Any) -> None:
    """Wait for every rank of ``group``."""
    if _group_size(group) > 1:
        dist.barrier(group=group)
