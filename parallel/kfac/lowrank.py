"""Factors too wide to hold densely: low rank plus diagonal, in memory linear in the width.

A factor ``F`` (d wide, d above ``kfac.max_factor_dim``) is never formed. What is kept:

- ``Omega``, a d x m Gaussian test matrix fixed for the run (m = ``rank + oversample``,
  at most d), drawn from a seed derived from the layer's name, so every rank and every
  grid draws the same one;
- the running sketch ``Y = F Omega`` and the running diagonal ``diag(F)``, together one
  d x (m + 1) tensor. The running average is linear, so the running sketch is exactly the
  sketch of the running factor. A factor step captures ``F_new Omega`` and
  ``diag(F_new)`` straight from the patches (or rows): ``sum over patches a (a^T Omega)``;
  the sketches are sums like the Gram matrices they stand for, so the one world
  all-reduce of ``parallel.kfac.factors`` carries them (d (m + 1) values instead of
  d (d + 1) / 2).

At an inverse update the sketch gives a Nystrom approximation (the single-pass
fixed-rank PSD approximation of Tropp, Yurtsever, Udell & Cevher, 2017, shifted for
stability), ``F ~ U diag(lam) U^T`` with U d x rank orthonormal, eigenvalues below
``rank_tol`` times the largest dropped, and the diagonal residual
``D = diag(F) - diag(U diag(lam) U^T)`` (clamped at 0) added back: ``F ~ U lam U^T + D``
with ``F``'s exact diagonal. With m = d (rank at least the width) it is ``F`` itself.

The preconditioner stays the exactly damped Kronecker inverse ``(G x F + damping I)^-1``
of that form (the other factor, here called G, dense and eigendecomposed as
``Q diag(g) Q^T``): in Q's basis it is block diagonal, and block i is
``(g_i F + damping I)^-1 = (E_i + U K_i U^T)^-1`` with ``E_i = g_i D + damping`` and
``K_i = g_i lam``, which Woodbury's identity solves through a rank x rank core per
eigenvalue of G: ``E^-1 - E^-1 U S_i U^T E^-1`` with
``S_i = K^1/2 (I + K^1/2 U^T E_i^-1 U K^1/2)^-1 K^1/2``. The cores cost
``dim G * d * rank^2`` flops per inverse update; a step then costs ~``4 dim G * d * rank``.

``Blocked`` is the hierarchical form: the diagonal replaced by dense diagonal blocks over
given index sets (a Flatten+Linear's spatial blocks), each held as its eigendecomposition,
so that ``E_i`` is block diagonal and applied block by block.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Sequence

import torch

from parallel.kfac.patches import patch_count, patch_slabs

NYSTROM_FLOPS_PER_DM2 = 6.0
"""Flops of the Nystrom step per d m^2 (the product with Omega, the triangular solve, the
thin SVD)."""


@dataclass
class Structured:
    """``F ~ U diag(lam) U^T + diag(d)``: U (width, rank), lam (rank,), d (width,)."""

    u: torch.Tensor
    lam: torch.Tensor
    d: torch.Tensor

    @property
    def kept(self) -> int:
        """The rank kept after ``rank_tol``: eigenvalues above the rounding floor (100 eps of
        the largest; a factor of lower rank, as a Linear's A after few rows, keeps fewer)."""
        if not self.lam.numel():
            return 0
        floor = 100 * torch.finfo(self.lam.dtype).eps * float(self.lam.max())
        return int((self.lam > floor).sum()) if float(self.lam.max()) > 0 else 0

    def tensors(self) -> list[torch.Tensor]:
        return [self.u, self.lam, self.d]


def sketch_width(dim: int, rank: int, oversample: int) -> int:
    """Columns m of the test matrix: ``rank + oversample``, at most the width."""
    return min(dim, rank + oversample)


def omega(key: str, dim: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The layer's fixed Gaussian test matrix (dim, width): the same on every rank and grid."""
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(dim, width, dtype=torch.float64, generator=gen).to(device, dtype)


def sketch_rows(rows: torch.Tensor, om: torch.Tensor) -> torch.Tensor:
    """``[F Omega | diag(F)]`` for ``F = rows rows^T`` (rows: (dim, n)), never forming F."""
    return torch.cat([rows @ (rows.t() @ om), (rows * rows).sum(1, keepdim=True)], dim=1)


def channel_sketch(x: torch.Tensor, om: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """The sketch of ``channel_gram``: over the channel vectors of ``x`` ((N, C, ...))."""
    rows = x.transpose(0, 1).reshape(x.shape[1], -1).to(dtype)
    return sketch_rows(rows, om), rows.shape[1]


def patch_sketch(x: torch.Tensor, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int],
                 bias: bool, om: torch.Tensor, dtype: torch.dtype, chunk_bytes: float) -> tuple[torch.Tensor, int]:
    """The sketch ``[A Omega | diag(A)]`` of ``patch_gram``'s sum (rows of Omega ordered
    (channel, offset), then the bias) and the number of patches, slab by slab."""
    c, k, count = patch_count(x, kernel, stride, dilation)
    dim, m = c * k, om.shape[1]
    # Omega's rows in the slabs' (offset, channel) order
    om_rows = om[:dim].reshape(c, k, m).transpose(0, 1).reshape(dim, m)
    y = torch.zeros(dim, m, dtype=dtype, device=x.device)
    diag = torch.zeros(dim, dtype=dtype, device=x.device)
    y_bias = torch.zeros(m, dtype=dtype, device=x.device)
    for rows in patch_slabs(x, kernel, stride, dilation, dtype, chunk_bytes):
        t = rows.t() @ om_rows
        if bias:  # a = (patch, 1): a^T Omega gains Omega's bias row; the bias row of A Omega sums it
            t += om[dim]
            y_bias += t.sum(0)
        y += rows @ t
        diag += (rows * rows).sum(1)
    out = torch.empty(dim + int(bias), m + 1, dtype=dtype, device=x.device)
    out[:dim, :m] = y.view(k, c, m).transpose(0, 1).reshape(dim, m)
    out[:dim, m] = diag.view(k, c).t().reshape(dim)
    if bias:
        out[dim, :m] = y_bias
        out[dim, m] = count
    return out, count


def nystrom(sketch: torch.Tensor, om: torch.Tensor, rank: int, tol: float, dtype: torch.dtype) -> Structured:
    """``U lam U^T + D`` from the running ``[F Omega | diag(F)]`` (the module's docstring)."""
    y, diag = sketch[:, :-1].to(dtype), sketch[:, -1].to(dtype)
    om = om.to(dtype)
    dim, m = y.shape
    scale = float(torch.linalg.matrix_norm(y, ord=2)) if y.numel() else 0.0
    rank = min(rank, m)
    if scale == 0.0:
        return Structured(y.new_zeros(dim, rank), y.new_zeros(rank), diag.clamp(min=0.0))
    nu = dim**0.5 * torch.finfo(dtype).eps * scale
    for _ in range(8):
        y_nu = y + nu * om
        core = om.t() @ y_nu
        chol, info = torch.linalg.cholesky_ex((core + core.t()) / 2)
        if int(info) == 0:
            break
        nu *= 10.0  # rounding left the shifted core indefinite: shift further
    else:
        raise RuntimeError(f"kfac: the Nystrom core of a {dim}-wide factor is not positive definite")
    b = torch.linalg.solve_triangular(chol, y_nu.t(), upper=False).t()  # y_nu chol^-T
    u, sigma, _ = torch.linalg.svd(b, full_matrices=False)
    lam = (sigma[:rank] ** 2 - nu).clamp(min=0.0)
    u = u[:, :rank]
    if tol > 0 and lam.numel():
        lam = torch.where(lam >= tol * lam[0], lam, torch.zeros_like(lam))
    d = (diag - (u * u) @ lam).clamp(min=0.0)
    return Structured(u.contiguous(), lam, d)


def cores(f: Structured, g: torch.Tensor, damping: float) -> torch.Tensor:
    """``S_i`` (the module's docstring) for every eigenvalue ``g_i`` of the dense factor:
    (dim G, rank, rank)."""
    n, r = g.shape[0], f.u.shape[1]
    out = f.u.new_empty(n, r, r)
    eye = torch.eye(r, dtype=f.u.dtype, device=f.u.device)
    for i in range(n):
        e_inv = 1.0 / (g[i] * f.d + damping)
        k = torch.sqrt(g[i] * f.lam)
        m = (f.u * e_inv[:, None]).t() @ f.u
        c = eye + k[:, None] * m * k[None, :]
        out[i] = k[:, None] * torch.linalg.solve(c, torch.diag(k))
    return out


def precondition_rows(w: torch.Tensor, f: Structured, g: torch.Tensor, s: torch.Tensor, damping: float
                      ) -> torch.Tensor:
    """Row i of ``w`` (in the dense factor's eigenbasis) times ``(g_i F + damping I)^-1``."""
    e = g[:, None] * f.d[None, :] + damping
    y = w / e
    z = torch.bmm(s, (y @ f.u)[:, :, None])[:, :, 0]
    return y - (z @ f.u.t()) / e


def precondition(v: torch.Tensor, wide: str, structured: Structured, dense: tuple[torch.Tensor, torch.Tensor],
                 s: torch.Tensor, damping: float) -> torch.Tensor:
    """``(G x A + damping I)^-1 v`` for a (dim G, dim A) gradient matrix ``v`` whose factor
    ``wide`` ("A" or "G") is structured and the other ``dense`` (eigenvectors, eigenvalues)."""
    q, g = dense
    v = v.to(q.dtype)
    if wide == "A":
        return q @ precondition_rows(q.t() @ v, structured, g, s, damping)
    return (q @ precondition_rows(q.t() @ v.t(), structured, g, s, damping)).t()


def memory_elements(dim: int, other: int, rank: int, oversample: int) -> int:
    """Elements a structured factor keeps per rank: Omega, the running sketch, the step's
    sums and the all-reduce buffer (each d (m + 1)), U, lam, D and the cores."""
    m = sketch_width(dim, rank, oversample)
    r = min(rank, m)
    return dim * m + 3 * dim * (m + 1) + dim * r + r + dim + other * r * r


@dataclass
class Blocked:
    """``F ~ blockdiag(B_s) + U diag(lam) U^T``: dense diagonal blocks over the index sets
    ``index[s]`` (each held as its eigendecomposition ``q[s] diag(e[s]) q[s]^T``) and a
    low-rank coupling. With one index per block it is ``Structured``'s diagonal form."""

    u: torch.Tensor
    lam: torch.Tensor
    index: list[torch.Tensor]
    q: list[torch.Tensor]
    e: list[torch.Tensor]

    @property
    def kept(self) -> int:
        """The coupling's rank above the rounding floor (``Structured.kept``)."""
        return Structured(self.u, self.lam, self.lam.new_zeros(0)).kept


def blocked(sketch: torch.Tensor, om: torch.Tensor, blocks: list[tuple[torch.Tensor, torch.Tensor]], rank: int,
            dtype: torch.dtype) -> Blocked:
    """The Nystrom coupling of the running ``[F Omega | diag(F)]`` and, for each
    ``(index, F[index][:, index])`` diagonal block, the residual ``F_ss - (U lam U^T)_ss``
    (its eigenvalues clamped at 0): the hierarchical form with the spatial blocks as leaves."""
    low = nystrom(sketch, om, rank, 0.0, dtype)
    qs, es = [], []
    for idx, f_ss in blocks:
        u_s = low.u[idx]
        e, q = torch.linalg.eigh(f_ss.to(dtype) - (u_s * low.lam) @ u_s.t())
        qs.append(q)
        es.append(e.clamp(min=0.0))
    return Blocked(low.u, low.lam, [idx for idx, _ in blocks], qs, es)


def _block_solve(w: torch.Tensor, f: Blocked, g: torch.Tensor, damping: float) -> torch.Tensor:
    """Row i of ``w`` times ``(g_i blockdiag(B_s) + damping I)^-1``, block by block."""
    out = torch.empty_like(w)
    for idx, q, e in zip(f.index, f.q, f.e):
        inner = (w[:, idx] @ q) / (g[:, None] * e[None, :] + damping)
        out[:, idx] = inner @ q.t()
    return out


def blocked_cores(f: Blocked, g: torch.Tensor, damping: float) -> torch.Tensor:
    """Woodbury cores ``S_i`` of the hierarchical form for every eigenvalue ``g_i``."""
    n, r = g.shape[0], f.u.shape[1]
    out = f.u.new_empty(n, r, r)
    eye = torch.eye(r, dtype=f.u.dtype, device=f.u.device)
    rotated = [q.t() @ f.u[idx] for idx, q in zip(f.index, f.q)]  # U's rows in each block's eigenbasis
    for i in range(n):
        m = sum(((w / (g[i] * e + damping)[:, None]).t() @ w) for w, e in zip(rotated, f.e))
        k = torch.sqrt(g[i] * f.lam)
        c = eye + k[:, None] * m * k[None, :]
        out[i] = k[:, None] * torch.linalg.solve(c, torch.diag(k))
    return out


def blocked_precondition(v: torch.Tensor, f: Blocked, dense: tuple[torch.Tensor, torch.Tensor], s: torch.Tensor,
                         damping: float) -> torch.Tensor:
    """``(G x A + damping I)^-1 v`` with A in the hierarchical form (v: (dim G, dim A))."""
    q, g = dense
    w = q.t() @ v.to(q.dtype)
    y = _block_solve(w, f, g, damping)
    z = torch.bmm(s, (y @ f.u)[:, :, None])[:, :, 0]
    return q @ (y - _block_solve(z @ f.u.t(), f, g, damping))
