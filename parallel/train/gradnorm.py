"""The whole model's gradient norm, the same on every rank, and the decisions taken from it.

Ranks must agree on every decision of a step: whether it is finite (``train.nonfinite``,
the fp16 scaler's skip and its next scale) and how much the gradients are clipped
(``train.grad_clip``). Each is taken here from one global quantity, the 2-norm of the
serial model's gradient:

- a replicated parameter's gradient is identical on every rank after the sync (the
  all-reduce hands every rank the same sum), so each rank adds its squared norm once;
- a parameter sharded over the spatial group (``spatial_shard``: a Flatten+Linear weight's
  block columns, ``parallel.layers.linear``) holds another piece of the serial gradient
  on each spatial rank, the same on its data peers (the sync averaged it over the data
  group): the squared norms of those pieces are summed over the spatial group, so the
  serial weight is counted once. That sum is the only collective (one scalar, and only
  when a sharded parameter exists and the group has more than one rank).

A NaN or inf from any rank's computation reaches this norm on every rank: the sync's
all-reduce spreads it over the replicated gradients, and the spatial sum over the sharded
ones. The decision is read on the host once per step (``read_host``: the norm and the
loss in one transfer).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from parallel import comm


def grad_groups(params: Iterable[torch.nn.Parameter]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(replicated gradients, spatially sharded gradients) of ``params`` (those with one)."""
    replicated: list[torch.Tensor] = []
    sharded: list[torch.Tensor] = []
    for p in params:
        if p.grad is not None:
            (sharded if getattr(p, "spatial_shard", False) else replicated).append(p.grad)
    return replicated, sharded


def _squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the gradients' squared norms, in float64 (each tensor's norm in its own
    dtype first, as torch's ``clip_grad_norm_`` takes them, so no square overflows)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g).to(torch.float64) for g in grads])
    return norms.square().sum()


def global_grad_norm(params: Iterable[torch.nn.Parameter], grid: Any = None) -> torch.Tensor:
    """The 2-norm of the serial model's gradient (float64, on the grid's device), identical
    on every rank: replicated gradients counted once, sharded ones summed over the spatial
    group (a collective over it when ``params`` hold a sharded gradient: every rank of the
    group calls this, as every rank holds the same parameters)."""
    replicated, sharded = grad_groups(params)
    device = grid.device if grid is not None else (replicated or sharded or [torch.zeros(())])[0].device
    total = _squares(replicated, device)
    if sharded:
        part = _squares(sharded, device)
        if grid is not None and grid.spatial_size > 1:
            comm.all_reduce_(part, grid.spatial_group, "sum", caller="gradnorm: sharded gradients' squared norm")
        total = total + part
    return total.sqrt()


def read_host(*values: torch.Tensor) -> list[float]:
    """Scalars to the host in one transfer (one wait for the device per step)."""
    return torch.stack([v.detach().to(torch.float64).reshape(()) for v in values]).tolist()


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor ``clip_grad_norm_`` scales gradients by: ``max_norm / (norm + 1e-6)``,
    at most 1 (1 when clipping is off)."""
    if max_norm <= 0:
        return 1.0
    return min(max_norm / (norm + 1e-6), 1.0)


def scale_grads_(params: Iterable[torch.nn.Parameter], factor: float) -> None:
    """Multiply every gradient by ``factor`` in place (the factor in the gradient's dtype,
    as torch's clipping applies it)."""
    if factor == 1.0:
        return
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor)
