"""The hierarchical form of a sharded Flatten+Linear's A, its diagonal blocks on their owners.

A Flatten+Linear whose weight is sharded by block (``parallel.layers.linear``) gives rank p
the features ``I_p`` of its block; its gradient columns ``V[:, I_p]`` are complete there.
When ``kfac.flat_blocks`` matches or refines the grid's split of the flattened volume
(``refines``), every diagonal block of the hierarchical A (``lowrank.Blocked``) lies
inside one rank's features, and that rank alone accumulates, holds, eigendecomposes and
applies it (the bias feature's 1 x 1 block is every rank's). What is shared stays the
same on every rank, formed from sums over ranks:

- the sketch ``[A Omega | diag(A)]``: a row's ``a^T Omega = sum_p a_p^T Omega[I_p]`` is
  summed over the spatial group (rows x m values instead of rows x d), then rank p forms
  the rows ``I_p`` of ``A Omega`` and the world all-reduce assembles the whole sketch; the
  Nystrom coupling ``U diag(lam) U^T`` follows from it as before;
- each owned block's Gram sum ``sum a_s a_s^T`` is summed over the data group only;
- the Woodbury cores ``S_i`` need ``U^T E_i^-1 U = sum_s R_s^T (g_i e_s + damping)^-1 R_s``
  (``R_s = q_s^T U_s``): each rank sums its blocks' terms, one all-reduce over the spatial
  group adds them (dim G x r x r values per inverse update);
- a step's ``(Q_G^T V) E^-1 U``, summed the same way (dim G x r values), gives the
  correction ``Z = S (Y U)`` every rank applies to its own columns.

So the preconditioned gradient of the rank's columns is computed where they are, and the
diagonal blocks' memory per rank falls as 1 / (spatial ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from parallel import comm
from parallel.kfac.lowrank import Structured
from parallel.partition import SplitError, block_bounds


def refines(split: Sequence[int], spatial: Sequence[int], dims: Sequence[int]) -> bool:
    """Whether ``split`` (``kfac.flat_blocks``) cuts a (D, H, W) volume at every boundary the
    grid's ``spatial`` split cuts it (each block then lies inside one rank's block)."""
    if len(split) != 3 or len(dims) != 3:
        return False
    for n, s, g in zip(dims, split, spatial):
        try:
            grid = {start for start, _ in block_bounds(int(n), int(g))}
        except SplitError:
            return False
        flat, start = set(), 0
        for part in torch.tensor_split(torch.arange(int(n)), int(s)):
            flat.add(start)
            start += part.numel()
        if not grid <= flat:
            return False
    return True


@dataclass
class Own:
    """This rank's part of a hierarchical A: its features ``cols`` (global indices,
    ascending: the sharded weight's column order), the blocks it holds (their numbers in
    ``Layer.blocks``) and their positions among its gradient's columns (the bias, if any,
    after ``cols``); ``shared``: how many of the last held blocks every rank holds (the bias')."""

    cols: torch.Tensor
    blocks: list[int]
    pos: list[torch.Tensor]
    shared: int


def own(blocks: list[torch.Tensor], cols: torch.Tensor, bias: bool) -> Own:
    """The blocks inside ``cols`` (each block is inside or outside: ``refines``)."""
    inside = torch.zeros(int(max(int(b.max()) for b in blocks)) + 1, dtype=torch.bool, device=cols.device)
    inside[cols] = True
    mine, pos = [], []
    last = len(blocks) - 1 if bias else len(blocks)
    for i, b in enumerate(blocks[:last]):
        hit = inside[b]
        if bool(hit.all()):
            mine.append(i)
            pos.append(torch.searchsorted(cols, b))
        elif bool(hit.any()):
            raise ValueError(f"kfac: diagonal block {i} of a sharded Flatten+Linear straddles this rank's block "
                             "(kfac.flat_blocks must match or refine parallel.spatial)")
    if bias:
        mine.append(last)
        pos.append(torch.tensor([cols.numel()], device=cols.device))
    return Own(cols, mine, pos, int(bias))


def sharding_policy(selected: Callable[[str, nn.Module], bool], split: Sequence[int]
                    ) -> Callable[[str, nn.Module, tuple[int, ...]], bool]:
    """``parallelize``'s ``shard_linear`` policy under K-FAC: shard a Flatten+Linear's weight
    where its A takes the hierarchical form local to the blocks (``selected(name, module)``:
    K-FAC holds its A hierarchically; ``split`` refines the grid's split of the (C, D, H, W)
    volume); the others stay whole, their features assembled over the spatial group."""
    def policy(name: str, module: nn.Module, shape: tuple[int, ...]) -> bool:
        grid: Any = getattr(module, "grid", None)
        return bool(split) and grid is not None and len(shape) == 4 and selected(name, module) and \
            refines(split, grid.spatial, shape[1:])
    return policy


@dataclass
class LocalBlocked:
    """The hierarchical form as rank p holds it: the coupling ``u`` (d, r) and ``lam`` (the
    same on every rank), ``u_own`` (U's rows of the rank's columns, then the bias'), and
    the owned blocks' positions ``pos`` and eigendecompositions ``q``, ``e``."""

    u: torch.Tensor
    lam: torch.Tensor
    u_own: torch.Tensor
    pos: list[torch.Tensor]
    q: list[torch.Tensor]
    e: list[torch.Tensor]
    shared: int
    group: Any

    @property
    def kept(self) -> int:
        """The coupling's rank above the rounding floor (``lowrank.Structured.kept``)."""
        return Structured(self.u, self.lam, self.lam.new_zeros(0)).kept

    def _split(self) -> int:
        return len(self.q) - self.shared


def _sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    return comm.all_reduce_(t, group) if group is not None and comm.group_size(group) > 1 else t


def _rotated(f: LocalBlocked) -> list[torch.Tensor]:
    return [q.t() @ f.u_own[p] for p, q in zip(f.pos, f.q)]


def cores(f: LocalBlocked, g: torch.Tensor, damping: float) -> torch.Tensor:
    """The Woodbury cores ``S_i`` (``lowrank.blocked_cores``) from the owned blocks' terms,
    summed over the spatial group (collective)."""
    n, r = g.shape[0], f.u.shape[1]
    rotated = _rotated(f)
    k_own = f._split()

    def terms(blocks: range) -> torch.Tensor:
        m = f.u.new_zeros(n, r, r)
        for j in blocks:
            w, e = rotated[j], f.e[j]
            for i in range(n):
                m[i] += (w / (g[i] * e + damping)[:, None]).t() @ w
        return m

    m = _sum(terms(range(k_own)), f.group) + terms(range(k_own, len(f.q)))
    out = f.u.new_empty(n, r, r)
    eye = torch.eye(r, dtype=f.u.dtype, device=f.u.device)
    for i in range(n):
        k = torch.sqrt(g[i] * f.lam)
        c = eye + k[:, None] * m[i] * k[None, :]
        out[i] = k[:, None] * torch.linalg.solve(c, torch.diag(k))
    return out


def _solve(w: torch.Tensor, f: LocalBlocked, g: torch.Tensor, damping: float) -> torch.Tensor:
    out = torch.empty_like(w)
    for p, q, e in zip(f.pos, f.q, f.e):
        out[:, p] = ((w[:, p] @ q) / (g[:, None] * e[None, :] + damping)) @ q.t()
    return out


def precondition(v: torch.Tensor, f: LocalBlocked, dense: tuple[torch.Tensor, torch.Tensor], s: torch.Tensor,
                 damping: float) -> torch.Tensor:
    """This rank's columns of ``(G x A + damping I)^-1 V`` (v: (dim G, own columns + bias));
    one all-reduce of dim G x r values over the spatial group (collective)."""
    q, g = dense
    w = q.t() @ v.to(q.dtype)
    y = _solve(w, f, g, damping)
    k_own = f._split()
    own_cols = torch.cat(f.pos[:k_own]) if k_own else f.pos[0][:0]
    t = _sum(y[:, own_cols] @ f.u_own[own_cols], f.group)
    for p in f.pos[k_own:]:
        t = t + y[:, p] @ f.u_own[p]
    z = torch.bmm(s, t[:, :, None])[:, :, 0]
    return q @ (y - _solve(z @ f.u_own.t(), f, g, damping))


def inner(p: torch.Tensor, v: torch.Tensor, f: LocalBlocked) -> torch.Tensor:
    """``sum(P * V)`` over the whole weight from the rank's columns: the owned columns'
    part summed over the spatial group, the shared (bias) column's once (collective)."""
    k_own = f._split()
    prod = p * v.to(p.dtype)
    shared = torch.cat(f.pos[k_own:]) if f.shared else f.pos[0][:0]
    mine = prod.sum() - prod[:, shared].sum()
    return _sum(mine.reshape(1), f.group)[0] + prod[:, shared].sum()


def gather(parts: list[torch.Tensor], held: list[int], count: int, group: Any) -> list[torch.Tensor]:
    """Every block's tensor, in block order, from each rank's tensors of the blocks ``held``
    (collective over ``group``; a block that several ranks hold, the bias', from the first)."""
    flat = torch.cat([p.reshape(-1) for p in parts])
    meta = torch.tensor(held + [p.numel() for p in parts], dtype=torch.int64, device=flat.device)
    flats = comm.all_gather_varlen(flat, group, caller="kfac: gathering the diagonal blocks")
    metas = comm.all_gather_varlen(meta, group, caller="kfac: gathering the diagonal blocks")
    out: list[torch.Tensor | None] = [None] * count
    for f, m in zip(flats, metas):
        numbers = m.tolist()
        k = len(numbers) // 2
        for j, piece in zip(numbers[:k], torch.split(f, numbers[k:])):
            if out[j] is None:
                out[j] = piece.clone()
    missing = [j for j, t in enumerate(out) if t is None]
    if missing:
        raise RuntimeError(f"kfac: no rank of the spatial group holds diagonal blocks {missing}")
    return out  # type: ignore[return-value]


def block_bytes(sizes: Sequence[int], factor: torch.dtype, inverse: torch.dtype) -> int:
    """Bytes of diagonal blocks of these sizes on one rank: each block's running Gram, the
    step's sums and the all-reduce buffer (triangles, in the factors' precision), and its
    eigenvectors and eigenvalues (in the inverses')."""
    f, i = torch.finfo(factor).bits // 8, torch.finfo(inverse).bits // 8
    return sum(3 * f * (n * (n + 1) // 2) + i * (n * n + n) for n in sizes)
