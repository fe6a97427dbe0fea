"""Eigendecompositions of the factors, spread over the ranks, and the preconditioning.

Every rank holds every factor (identical after the all-reduce). Each factor is one work
item of cost ~ dim^3; items are assigned longest first to the least-loaded rank (the LPT
rule: the busiest rank ends within 4/3 of the best possible balance), each rank
decomposes its own, and each owner broadcasts its results packed in one buffer. The
decomposition time of a step is that of the busiest rank, so it falls as ranks are added
until one factor dominates (``docs/kfac.md``).

With ``A = Q_A diag(a) Q_A^T`` and ``G = Q_G diag(g) Q_G^T``, the gradient matrix V
(dim G x dim A) is preconditioned by ``(G x A + damping I)^-1`` exactly:
``Q_G [(Q_G^T V Q_A) / (g a^T + damping)] Q_A^T``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from parallel import comm

EIGH_FLOPS_PER_DIM3 = 9.0
"""Flops of a symmetric eigendecomposition with vectors per dim^3 (Golub & Van Loan's count for
tridiagonalisation plus implicit QR; divide and conquer does less)."""

Eigen = tuple[torch.Tensor, torch.Tensor]


def assign(costs: Sequence[float], ranks: int) -> list[int]:
    """The rank that computes each item: largest first, each to the least-loaded rank
    (ties to the lower rank, so every rank computes the same answer)."""
    if ranks < 1:
        raise ValueError(f"cannot assign work to {ranks} ranks")
    load = [0.0] * ranks
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner


def loads(costs: Sequence[float], owner: Sequence[int], ranks: int) -> list[float]:
    """Total cost per rank of an assignment."""
    out = [0.0] * ranks
    for c, r in zip(costs, owner):
        out[r] += c
    return out


def eigen(factor: torch.Tensor, dtype: torch.dtype) -> Eigen:
    """(eigenvectors, eigenvalues clamped at 0) of a symmetric positive semi-definite factor."""
    values, vectors = torch.linalg.eigh(factor.to(dtype))
    return vectors, values.clamp(min=0.0)


def decompose(factors: list[torch.Tensor], dtype: torch.dtype, group: Any, world_size: int, rank: int
              ) -> list[Eigen]:
    """The eigendecomposition of every factor, each computed by one rank and broadcast
    over ``group`` (whose ranks are the global ranks 0..world_size-1). Collective."""
    items = [Item(float(f.shape[0]) ** 3, (lambda f=f: list(eigen(f, dtype))), [(f.shape[0], f.shape[0]),
                                                                                 (f.shape[0],)])
             for f in factors]
    device = factors[0].device if factors else torch.device("cpu")
    return [(r[0], r[1]) for r in spread(items, dtype, device, group, world_size, rank)]


@dataclass
class Item:
    """One unit of inverse work: its cost, how to compute it, and the shapes of its results."""

    cost: float
    compute: Callable[[], list[torch.Tensor]]
    shapes: list[tuple[int, ...]]


def spread(items: list[Item], dtype: torch.dtype, device: torch.device, group: Any, world_size: int, rank: int
           ) -> list[list[torch.Tensor]]:
    """Every item computed by one rank (``assign`` on the costs) and broadcast over ``group``
    in one packed buffer per owner. Collective."""
    owner = assign([it.cost for it in items], world_size)
    results: list[list[torch.Tensor] | None] = [it.compute() if owner[i] == rank else None
                                                for i, it in enumerate(items)]
    if world_size > 1:
        sizes = [[math.prod(shape) for shape in it.shapes] for it in items]
        for src in range(world_size):
            mine = [i for i in range(len(items)) if owner[i] == src]
            if not mine:
                continue
            if src == rank:
                buf = torch.cat([t.reshape(-1).to(dtype) for i in mine for t in results[i]])  # type: ignore[union-attr]
            else:
                buf = torch.empty(sum(sum(sizes[i]) for i in mine), dtype=dtype, device=device)
            comm.broadcast_(buf, src, group)
            offset = 0
            for i in mine:
                out = []
                for shape, n in zip(items[i].shapes, sizes[i]):
                    out.append(buf[offset:offset + n].view(shape))
                    offset += n
                results[i] = out
    return results  # type: ignore[return-value]


def precondition(v: torch.Tensor, eig_a: Eigen, eig_g: Eigen, damping: float) -> torch.Tensor:
    """``(G x A + damping I)^-1 v`` for a (dim G, dim A) gradient matrix ``v``."""
    qa, la = eig_a
    qg, lg = eig_g
    v = v.to(qa.dtype)
    inner = qg.t() @ v @ qa
    inner = inner / (lg[:, None] * la[None, :] + damping)
    return qg @ inner @ qa.t()
