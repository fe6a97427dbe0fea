"""Convolution with the halo exchange hidden behind the interior.

The output voxels of a block whose inputs lie inside the block (the interior) need no
halo. The forward starts the exchange (``halo.in_background``), convolves the interior
from the block itself, then, once the window has arrived, the boundary slabs from the
window. The backward runs the same way round: the input gradients of the boundary slabs
first, whose halo parts go back to their owners while the interior's input gradient and
the weight gradient are computed.

What runs beside what: on CPUs (gloo) the exchange runs on the halo thread while this
thread convolves. On GPUs (NCCL) the exchange is queued on a dedicated CUDA stream
(packing, the NCCL messages, unpacking) while the interior's kernels are queued on the
caller's stream; the caller's stream then waits for the side stream, and the window is
recorded for it. How much the two streams overlap is up to the GPU; it has not been
measured (no GPU was available, docs/performance.md).

Numbers are those of the plain path: every output voxel is the same dot product, and
every gradient the same sums, only cut into pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from parallel.halo import ExchangePlan, fetch_all, in_background, reduce_all
from parallel.layers.kernels import conv3d, conv3d_backward

Range = tuple[int, int]


@dataclass(frozen=True)
class OverlapPlan:
    """Where the interior and the boundary slabs of this rank's output lie.

    Ranges are in local output indices per axis (D, H, W); ``x_offset[a]`` is where
    output index 0 starts reading in the block along an exchanged axis (negative: in the
    halo), 0 elsewhere; the window starts reading at 0.
    """

    steps: tuple[tuple[int, ExchangePlan], ...]   # (tensor dim, plan) of the exchanged axes
    exchanged: tuple[bool, bool, bool]
    x_offset: tuple[int, int, int]
    interior: tuple[Range, Range, Range]
    slabs: tuple[tuple[Range, Range, Range], ...]


def interior(out_len: int, block_len: int, offset: int, stride: int, span: int) -> Range:
    """Local output indices ``[i0, i1)`` whose inputs lie inside the block (may be empty).

    Output ``o`` reads block indices ``[o * stride + offset, o * stride + offset + span)``.
    """
    i0 = -(offset // stride) if offset < 0 else 0             # first o with o*s + offset >= 0
    i1 = min(out_len, (block_len - span - offset) // stride + 1)  # last o reading inside, + 1
    return i0, i1


def overlap_plan(steps: list[tuple[int, ExchangePlan]], out_len: list[int], block_len: list[int],
                 x_offset: list[int], stride: tuple[int, ...], span: list[int]) -> OverlapPlan:
    """The interior/boundary cut of this rank's output (the interior must not be empty)."""
    exchanged = [False, False, False]
    for dim, _ in steps:
        exchanged[dim - 2] = True
    ranges: list[Range] = [(0, m) for m in out_len]
    slabs: list[tuple[Range, Range, Range]] = []
    for a in range(3):
        if not exchanged[a]:
            continue
        m = out_len[a]
        i0, i1 = interior(m, block_len[a], x_offset[a], stride[a], span[a])
        if i1 <= i0:
            raise ValueError(f"no interior along axis {a}: outputs {m}, block {block_len[a]}")
        for lo, hi in ((0, i0), (i1, m)):
            if hi > lo:
                cut = list(ranges)
                cut[a] = (lo, hi)
                slabs.append(tuple(cut))  # type: ignore[arg-type]
        ranges[a] = (i0, i1)
    return OverlapPlan(tuple(steps), tuple(exchanged), tuple(x_offset), tuple(ranges),  # type: ignore[arg-type]
                       tuple(slabs))


def _out_index(r: tuple[Range, ...]) -> tuple[slice, ...]:
    return (slice(None), slice(None), *(slice(a, b) for a, b in r))


def _in_index(r: tuple[Range, ...], plan: OverlapPlan, stride: tuple[int, ...], span: tuple[int, ...],
              offset: bool) -> tuple[slice, ...]:
    """The input (window, or block when ``offset``) that output region ``r`` reads."""
    idx: list[slice] = [slice(None), slice(None)]
    for a, (lo, hi) in enumerate(r):
        if not plan.exchanged[a]:
            idx.append(slice(None))
            continue
        shift = plan.x_offset[a] if offset else 0
        idx.append(slice(lo * stride[a] + shift, (hi - 1) * stride[a] + span[a] + shift))
    return tuple(idx)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


class OverlapConv(torch.autograd.Function):
    """conv3d of the window ``fetch_all(x)`` with the exchange hidden behind the interior."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                plan: OverlapPlan, conv: tuple) -> torch.Tensor:
        stride, pads, dilation, groups, span = conv
        dtype = _compute_dtype(x)
        dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        with torch.autocast(x.device.type, enabled=False):
            x, weight = x.detach().to(dtype), weight.detach().to(dtype)
            bias = None if bias is None else bias.detach().to(dtype)
            pending = in_background(fetch_all, x, plan.steps)
            try:
                inner = conv3d(x[_in_index(plan.interior, plan, stride, span, True)], weight, bias,
                               stride, pads, dilation, groups)
            finally:
                window = pending.result()
            shape = [inner.shape[0], inner.shape[1]]
            for a in range(3):
                shape.append(max(hi for _, hi in [plan.interior[a], *(r[a] for r in plan.slabs)]))
            out = inner.new_empty(shape)
            out[_out_index(plan.interior)] = inner
            del inner
            for r in plan.slabs:
                out[_out_index(r)] = conv3d(window[_in_index(r, plan, stride, span, False)], weight, bias,
                                            stride, pads, dilation, groups)
        ctx.save_for_backward(window, weight)
        ctx.plan, ctx.conv, ctx.dtypes, ctx.has_bias = plan, conv, dtypes, bias is not None
        ctx.x_shape = tuple(x.shape)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        window, weight = ctx.saved_tensors
        plan: OverlapPlan = ctx.plan
        stride, pads, dilation, groups, span = ctx.conv
        grad = grad.to(window.dtype).contiguous()
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]

        def conv_backward(region: tuple[Range, ...]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            """Input and weight gradients of one output region, in one call."""
            return conv3d_backward(grad[_out_index(region)], window[_in_index(region, plan, stride, span, False)],
                                   weight, stride, pads, dilation, groups, (need_x, need_w))

        gw_total = None
        pending = None
        edges = torch.zeros_like(window) if need_x else None
        try:
            # The boundary slabs first: their input gradients hold the halo parts, which go
            # back to their owners while the interior is computed.
            for r in plan.slabs:
                gi, gw = conv_backward(r)
                if edges is not None:
                    edges[_in_index(r, plan, stride, span, False)] += gi
                if gw is not None:
                    gw_total = gw if gw_total is None else gw_total + gw
            if edges is not None:
                pending = in_background(reduce_all, edges, plan.steps)
                del edges
            inner, gw = conv_backward(plan.interior)
            if gw is not None:
                gw_total = gw if gw_total is None else gw_total + gw
            gb = grad.sum((0, 2, 3, 4)).to(ctx.dtypes[2]) if ctx.has_bias and ctx.needs_input_grad[2] else None
        finally:
            gx = pending.result() if pending is not None else None
        if gx is not None:
            gx[_in_index(plan.interior, plan, stride, span, True)] += inner
            gx = gx.to(ctx.dtypes[0])
        gw_out = gw_total.to(ctx.dtypes[1]) if gw_total is not None else None
        return gx, gw_out, gb, None, None
