"""From the step's captured statistics to the serial factors, identical on every rank.

Normalisation (the serial definition, ``docs/kfac.md``), with ``g`` the output gradient
of the step's loss (a mean over the rows of the batch) and ``N`` the rows:

    A = (1 / #patches) sum over rows and positions of a a^T
    G = N * sum over rows and positions of g g^T        (= mean over rows of the per-row
                                                          gradient's sum of outer products)

Each rank holds a part of those sums. Convolutions: its output block's positions (the
spatial sum of the parts is the whole). Linear layers: every rank of a spatial group
computes the same thing once the features (``SpatialLinear``: zero rows but for the
block) and the output gradients (each rank holds ``1/S`` of it, ``parallel.comm``) are
summed over the spatial group, so each rank contributes ``1/S`` of its copy. One
all-reduce over the world then sums everything: the A sums and patch counts pool over
data groups; the G parts are each data group's ``N_d sum g g^T`` over ``D``, a mean over
data groups like the gradients' own. Factors travel as upper triangles (half the bytes).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from parallel import comm
from parallel.kfac.layers import Layer
from parallel.kfac.lowrank import sketch_rows


@functools.lru_cache(maxsize=256)
def _triu(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices of the upper triangle of an n x n matrix, row by row, and of its mirror
    (kept: every factor update packs and unpacks the same widths)."""
    r, c = torch.triu_indices(n, n, device=device)
    return r * n + c, c * n + r


def pack(m: torch.Tensor) -> torch.Tensor:
    """The upper triangle of the symmetric ``m``, row by row."""
    upper, _ = _triu(m.shape[0], m.device)
    return m.reshape(-1).index_select(0, upper)


def unpack(v: torch.Tensor, n: int) -> torch.Tensor:
    """The symmetric n x n matrix whose upper triangle is ``v``."""
    upper, lower = _triu(n, v.device)
    m = v.new_empty(n * n)
    m.index_copy_(0, lower, v)
    m.index_copy_(0, upper, v)
    return m.view(n, n)


def packed_size(n: int) -> int:
    return n * (n + 1) // 2


def _linear_rows(layers: list[Layer], dtype: torch.dtype, spatial_group: Any, spatial_size: int
                 ) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Each linear layer's (features, output gradients), summed over the spatial group; a
    Flatten+Linear held local to its blocks keeps its block's features and gets the rows'
    ``a^T Omega`` summed instead (``parallel.kfac.local``), the third entry."""
    rows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
    for i, layer in enumerate(layers):
        if not layer.replicated:
            continue
        dim_in = layer.dim_a - (layer.bias is not None) if layer.own is None else layer.own.cols.numel()
        device = layer.weight.device
        a = torch.cat(layer.lin_a).to(dtype) if layer.lin_a else torch.zeros(0, dim_in, dtype=dtype, device=device)
        g = torch.cat(layer.lin_g).to(dtype) if layer.lin_g else torch.zeros(0, layer.dim_g, dtype=dtype,
                                                                             device=device)
        t = None if layer.own is None else a @ layer.omega[layer.own.cols].to(dtype)  # type: ignore[index]
        rows[i] = (a, g, t)
    if spatial_size > 1 and rows:
        # Plain Linear layers' features are replicated already; only their gradients need the sum.
        def summed(i: int, a: torch.Tensor, g: torch.Tensor, t: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
            return (g,) if layers[i].kind != "flat" else (t, g) if t is not None else (a, g)

        parts = [x for i, (a, g, t) in rows.items() for x in summed(i, a, g, t)]
        flat = comm.all_reduce_(torch.cat([x.reshape(-1) for x in parts]), spatial_group)
        offset, out = 0, {}
        for i, (a, g, t) in rows.items():
            pieces = []
            for x in summed(i, a, g, t):
                pieces.append(flat[offset:offset + x.numel()].view_as(x))
                offset += x.numel()
            if layers[i].kind != "flat":
                out[i] = (a, pieces[0], None)
            else:
                out[i] = (a, pieces[1], pieces[0]) if t is not None else (pieces[0], pieces[1], None)
        rows = out
    return rows


def _local_sums(layer: Layer, a: torch.Tensor, t: torch.Tensor, spatial: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Flatten+Linear held local to its blocks: this rank's part of the whole sketch
    ``[A Omega | diag(A)]`` (its features' rows; the bias row, which every rank forms alike,
    as 1 / spatial of it), flattened, and its own blocks' Gram sums (triangles, the bias
    block's last)."""
    own = layer.own
    assert own is not None and layer.omega is not None
    om = layer.omega.to(a.dtype)
    bias = layer.bias is not None
    if bias:
        t = t + om[-1]  # each row's bias feature, 1, times Omega's bias row
    d, m = layer.dim_a, om.shape[1]
    sketch = a.new_zeros(d, m + 1)
    sketch[own.cols, :m] = a.t() @ t
    sketch[own.cols, m] = (a * a).sum(0)
    if bias:
        sketch[d - 1, :m] = t.sum(0) / spatial
        sketch[d - 1, m] = a.shape[0] / spatial
    grams = [pack(a[:, p].t() @ a[:, p]) for p in own.pos[:len(own.pos) - own.shared]]
    if bias:
        grams.append(a.new_full((1,), float(a.shape[0])))
    return sketch.reshape(-1), torch.cat(grams)


def reduce_factors(layers: list[Layer], dtype: torch.dtype, grid: Any, grad_scale: float = 1.0
                   ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """This step's (A, G) of every layer, reduced over all ranks (collective); None for a
    layer that captured nothing on any rank."""
    spatial = grid.spatial_size if grid is not None else 1
    data = grid.data_size if grid is not None else 1
    lin = _linear_rows(layers, dtype, grid.spatial_group if grid is not None else None, spatial)
    parts: list[torch.Tensor] = []
    local: list[torch.Tensor] = []  # the own diagonal blocks of layers held local to them: summed over data
    for i, layer in enumerate(layers):
        device = layer.weight.device
        a_share = None
        if layer.own is not None:
            a, g, t = lin[i]
            a_sum, grams = _local_sums(layer, a, t, spatial)  # type: ignore[arg-type]
            local.append(grams)
            g_sum, count, share, a_share = _rows_sum(layer, "G", g), float(a.shape[0]), 1.0 / spatial, 1.0
        elif layer.replicated:
            a, g, _ = lin[i]
            if layer.bias is not None:
                a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
            a_sum, g_sum = _rows_sum(layer, "A", a), _rows_sum(layer, "G", g)
            count, share = float(a.shape[0]), 1.0 / spatial
        else:
            a_sum = layer.a_sum if layer.a_sum is not None else torch.zeros(layer.shape("A"), dtype=dtype,
                                                                            device=device)
            g_sum = layer.g_sum if layer.g_sum is not None else torch.zeros(layer.shape("G"), dtype=dtype,
                                                                            device=device)
            count, share = layer.a_count, 1.0
        g_scale = share * layer.rows / data / grad_scale**2
        a_part = _pack(layer, "A", a_sum.to(dtype)) * (share if a_share is None else a_share)
        parts += [a_part, torch.tensor([count * share], dtype=dtype, device=device),
                  _pack(layer, "G", g_sum.to(dtype)) * g_scale]
    if not parts:
        return []
    flat = comm.all_reduce_(torch.cat(parts), grid.world_group if grid is not None else None)
    starts, offset = [], 0
    for layer in layers:
        starts.append(offset)
        offset += _size(layer, "A") + 1 + _size(layer, "G")
    counts = flat[[s + _size(layer, "A") for s, layer in zip(starts, layers)]].tolist()  # one sync
    if local and data > 1:
        blocks = comm.all_reduce_(torch.cat(local), grid.data_group)
        local = list(torch.split(blocks, [x.numel() for x in local]))
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for s, count, layer in zip(starts, counts, layers):
        na, ng = _size(layer, "A"), _size(layer, "G")
        a, g = flat[s:s + na], flat[s + na + 1:s + na + 1 + ng]
        if layer.own is not None:
            a = torch.cat([a, local.pop(0)])
        out.append((_unpack(layer, "A", a) / count, _unpack(layer, "G", g)) if count > 0 else None)
    return out


def _rows_sum(layer: Layer, side: str, rows: torch.Tensor) -> torch.Tensor:
    """``rows^T rows`` for a linear layer's (N, d) rows, or its sketch if that factor is wide."""
    if layer.wide == side:
        sketch = sketch_rows(rows.t(), layer.omega.to(rows.dtype))  # type: ignore[union-attr]
        if side == "A" and layer.blocks is not None:  # hierarchical: then each diagonal block's Gram
            return torch.cat([sketch.reshape(-1)] + [pack(rows[:, b].t() @ rows[:, b]) for b in layer.blocks])
        return sketch
    return rows.t() @ rows


def _size(layer: Layer, side: str) -> int:
    """Values side ``side``'s factor takes in the all-reduce: an upper triangle, or a whole sketch."""
    if side == "A" and layer.own is not None:  # the sketch only: the own blocks are summed over data
        return layer.dim_a * (layer.omega.shape[1] + 1)  # type: ignore[union-attr]
    shape = layer.shape(side)
    return math.prod(shape) if side == layer.wide else packed_size(shape[0])


def _pack(layer: Layer, side: str, m: torch.Tensor) -> torch.Tensor:
    return m.reshape(-1) if side == layer.wide else pack(m)


def _unpack(layer: Layer, side: str, v: torch.Tensor) -> torch.Tensor:
    return v.view(layer.shape(side)) if side == layer.wide else unpack(v, layer.dim(side))


def factor_bytes(layers: list[Layer], itemsize: int) -> int:
    """Bytes of the world all-reduce of one factor update."""
    return itemsize * sum(_size(layer, "A") + 1 + _size(layer, "G") for layer in layers)
