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
                 ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each linear layer's (features, output gradients), summed over the spatial group."""
    rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, layer in enumerate(layers):
        if not layer.replicated:
            continue
        dim_in = layer.dim_a - (layer.bias is not None)
        device = layer.weight.device
        a = torch.cat(layer.lin_a).to(dtype) if layer.lin_a else torch.zeros(0, dim_in, dtype=dtype, device=device)
        g = torch.cat(layer.lin_g).to(dtype) if layer.lin_g else torch.zeros(0, layer.dim_g, dtype=dtype,
                                                                             device=device)
        rows[i] = (a, g)
    if spatial_size > 1 and rows:
        # Plain Linear layers' features are replicated already; only their gradients need the sum.
        parts = [t for i, (a, g) in rows.items() for t in ((a, g) if layers[i].kind == "flat" else (g,))]
        flat = comm.all_reduce_(torch.cat([t.reshape(-1) for t in parts]), spatial_group)
        offset, out = 0, {}
        for i, (a, g) in rows.items():
            pieces = []
            for t in ((a, g) if layers[i].kind == "flat" else (g,)):
                pieces.append(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
            out[i] = (pieces[0], pieces[1]) if layers[i].kind == "flat" else (a, pieces[0])
        rows = out
    return rows


def reduce_factors(layers: list[Layer], dtype: torch.dtype, grid: Any, grad_scale: float = 1.0
                   ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """This step's (A, G) of every layer, reduced over all ranks (collective); None for a
    layer that captured nothing on any rank."""
    spatial = grid.spatial_size if grid is not None else 1
    data = grid.data_size if grid is not None else 1
    lin = _linear_rows(layers, dtype, grid.spatial_group if grid is not None else None, spatial)
    parts: list[torch.Tensor] = []
    for i, layer in enumerate(layers):
        device = layer.weight.device
        if layer.replicated:
            a, g = lin[i]
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
        parts += [_pack(layer, "A", a_sum.to(dtype)) * share, torch.tensor([count * share], dtype=dtype, device=device),
                  _pack(layer, "G", g_sum.to(dtype)) * g_scale]
    if not parts:
        return []
    flat = comm.all_reduce_(torch.cat(parts), grid.world_group if grid is not None else None)
    starts, offset = [], 0
    for layer in layers:
        starts.append(offset)
        offset += _size(layer, "A") + 1 + _size(layer, "G")
    counts = flat[[s + _size(layer, "A") for s, layer in zip(starts, layers)]].tolist()  # one sync
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for s, count, layer in zip(starts, counts, layers):
        na, ng = _size(layer, "A"), _size(layer, "G")
        a, g = flat[s:s + na], flat[s + na + 1:s + na + 1 + ng]
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
    shape = layer.shape(side)
    return math.prod(shape) if side == layer.wide else packed_size(shape[0])


def _pack(layer: Layer, side: str, m: torch.Tensor) -> torch.Tensor:
    return m.reshape(-1) if side == layer.wide else pack(m)


def _unpack(layer: Layer, side: str, v: torch.Tensor) -> torch.Tensor:
    return v.view(layer.shape(side)) if side == layer.wide else unpack(v, layer.dim(side))


def factor_bytes(layers: list[Layer], itemsize: int) -> int:
    """Bytes of the world all-reduce of one factor update."""
    return itemsize * sum(_size(layer, "A") + 1 + _size(layer, "G") for layer in layers)
