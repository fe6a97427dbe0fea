"""Convolution of a split block without copying it into a window.

A convolution is linear in its input, and the window a rank convolves is its block plus
a thin shell of halos (``parallel.split.shell``). So the rank convolves the block itself,
zero-padded where the halos go (the same call, kernel and memory as the plain convolution
of the block), and then adds, in place, what each piece of the shell contributes to the
few output rows that read it, through the kernel taps that reach it. The backward is the
same sum: the plain convolution's backward on the block (its input gradient is the block's,
in place), plus the pieces' input gradients (sent back to their owners and added into
their blocks' gradients) and their weight gradients (into the taps they used).

Blocking (``overlap=False``): the shell is exchanged first. Overlapped: the exchange runs
beside the block's convolution (the halo thread on CPUs, a side stream on GPUs,
``parallel.split.halo.in_background``), and in the backward the pieces' gradients travel while
the block's backward runs. Both do the same arithmetic; the overlapped one pays a thread
hand-off per exchange and wins where messages take longer than that.

Numbers: every output voxel is the plain window convolution's dot product, split into the
block's part and the shell's part (one more rounding in float32); the tests compare with
``torch.nn`` in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from parallel.layers.conv.kernels import conv3d, conv3d_backward
from parallel.layers.precision import compute_dtypes
from parallel.split.halo import ExchangePlan, in_background
from parallel.split.shell import ShellStep, fetch_shell, reduce_shell, shell_step

Span = tuple[int, int]


@dataclass(frozen=True)
class Correction:
    """What one shell piece adds to the output: rows ``out_rows`` along ``dim``, from piece
    rows ``rows`` (with ``zeros`` zero rows before and after) through taps ``taps``."""

    level: int
    side: int                          # 0: left piece, 1: right piece
    dim: int
    rows: Span
    zeros: Span
    taps: Span
    out_rows: Span
    narrow: tuple[Span | None, ...]    # per spatial axis: the piece's input rows along the other dims
    pads: tuple[int, int, int]
    offsets: tuple[int, int, int]      # output rows to skip along the other dims (asymmetric padding)


@dataclass(frozen=True)
class ShellGeometry:
    """The block convolution (input rows, symmetric padding, output rows to skip) and the
    corrections of a split convolution."""

    steps: tuple[ShellStep, ...]
    core: tuple[Span | None, ...]      # per spatial axis: block rows the convolution reads (None: all)
    pads: tuple[int, int, int]
    offsets: tuple[int, int, int]
    out_len: tuple[int, int, int]
    corrections: tuple[Correction, ...]


def _pad(left: int, right: int, stride: int) -> tuple[int, int]:
    """Symmetric padding covering ``left``/``right`` and the output rows to skip for it."""
    if left >= right:
        return left, 0
    skip = -(-(right - left) // stride)
    return left + skip * stride, skip


def shell_geometry(plans: Sequence[ExchangePlan | None], windows: Sequence[tuple[int, int] | None],
                   blocks: Sequence[tuple[int, int]], native_pads: Sequence[int], out_len: Sequence[int],
                   kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int]) -> ShellGeometry | None:
    """The geometry for a conv whose exchanged axes have ``plans`` (None: padded natively)
    and this rank's ``windows``/``blocks``; None where a plan cannot be run as a shell."""
    steps, core, pads, offsets = [], [], [], []
    for a, plan in enumerate(plans):
        if plan is None:
            core.append(None)
            pads.append(native_pads[a])
            offsets.append(0)
            continue
        st = shell_step(a + 2, plan, windows[a], blocks[a])  # type: ignore[arg-type]
        if st is None:
            return None
        steps.append(st)
        core.append((st.core_src, st.core_len) if st.core_len != plan.in_len else None)
        p, skip = _pad(st.core_dst, st.right_len, stride[a])
        pads.append(p)
        offsets.append(skip)
    fixes = []
    for j, st in enumerate(steps):
        a = st.dim - 2
        earlier = {s.dim - 2 for s in steps[:j]}
        narrow = tuple(None if (b == a or b in earlier) else core[b] for b in range(3))
        other_pads = tuple(0 if (b == a or b in earlier) else pads[b] for b in range(3))
        other_offsets = tuple(0 if (b == a or b in earlier) else offsets[b] for b in range(3))
        k, s, d, m = kernel[a], stride[a], dilation[a], out_len[a]
        for side in (0, 1):
            fill = st.left_fill if side == 0 else st.right_fill
            length = st.core_dst if side == 0 else st.right_len
            if fill or length == 0:
                continue  # zeros (a volume edge) contribute nothing
            if side == 0:
                o0, o1 = 0, min(m, -(-length // s))
                t0, t1 = 0, min(k, -(-length // d))
                need = (o1 - 1) * s + (t1 - 1) * d + 1
                rows, zeros = (0, min(need, length)), (0, max(0, need - length))
            else:
                r0 = st.core_dst + st.core_len
                o0, o1 = max(0, -(-(r0 - (k - 1) * d) // s)), m
                t0, t1 = max(0, -(-(r0 - (m - 1) * s) // d)), k
                start, end = o0 * s + t0 * d, (m - 1) * s + (k - 1) * d + 1
                rows = (max(0, start - r0), end - r0)
                zeros = (max(0, r0 - start), 0)
            if o1 <= o0 or t1 <= t0:
                continue
            fixes.append(Correction(j, side, st.dim, rows, zeros, (t0, t1), (o0, o1), narrow,
                                    other_pads, other_offsets))  # type: ignore[arg-type]
    return ShellGeometry(tuple(steps), tuple(core), tuple(pads), tuple(offsets), tuple(out_len),  # type: ignore[arg-type]
                         tuple(fixes))


def _narrowed(t: torch.Tensor, spans: Sequence[Span | None]) -> torch.Tensor:
    for b, span in enumerate(spans):
        if span is not None:
            t = t.narrow(b + 2, *span)
    return t


def _crop(y: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int | None]) -> torch.Tensor:
    """Output rows ``[offset, offset + length)`` per spatial axis (None: all)."""
    for b in range(3):
        n = lengths[b]
        if n is not None and (offsets[b] or y.shape[b + 2] != n):
            y = y.narrow(b + 2, offsets[b], n)
    return y


def _uncrop(g: torch.Tensor, shape: Sequence[int], offsets: Sequence[int]) -> torch.Tensor:
    """The adjoint of ``_crop``: ``g`` placed in zeros of ``shape``."""
    if list(g.shape) == list(shape):
        return g
    full = g.new_zeros(shape)
    _crop(full, offsets, g.shape[2:]).copy_(g)
    return full


def _correction_input(fix: Correction, shell: list, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    piece = shell[fix.level][fix.side]
    x = _narrowed(piece.narrow(fix.dim, fix.rows[0], fix.rows[1] - fix.rows[0]), fix.narrow)
    if fix.zeros != (0, 0):  # rows of the block: zero in the shell's part of the sum
        parts = []
        for n in (fix.zeros[0], None, fix.zeros[1]):
            if n is None:
                parts.append(x)
            elif n:
                shape = list(x.shape)
                shape[fix.dim] = n
                parts.append(x.new_zeros(shape))
        x = torch.cat(parts, fix.dim)
    return x, weight.narrow(fix.dim, fix.taps[0], fix.taps[1] - fix.taps[0])


def _out_lengths(fix: Correction, geo: ShellGeometry) -> list[int | None]:
    return [None if b + 2 == fix.dim else geo.out_len[b] for b in range(3)]


class ShellConv(torch.autograd.Function):
    """conv3d of the window ``halo.fetch_all(x)``, computed as the block's convolution plus
    the shell's corrections (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                geo: ShellGeometry, conv: tuple, overlap: bool) -> torch.Tensor:
        stride, dilation, groups = conv
        dtype, work = compute_dtypes(x)
        dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        with torch.autocast(x.device.type, enabled=False):
            x, weight = x.detach().to(dtype).to(work), weight.detach().to(dtype).to(work)
            bias = None if bias is None else bias.detach().to(dtype).to(work)
            pending = in_background(fetch_shell, x, geo.steps) if overlap else None
            try:
                shell = fetch_shell(x, geo.steps) if pending is None else None
                y = conv3d(_narrowed(x, geo.core), weight, bias, stride, geo.pads, dilation, groups)
            finally:
                if pending is not None:
                    shell = pending.result()
            assert shell is not None
            out = _crop(y, geo.offsets, geo.out_len)
            for fix in geo.corrections:
                inp, w = _correction_input(fix, shell, weight)
                part = _crop(conv3d(inp, w, None, stride, fix.pads, dilation, groups), fix.offsets,
                             _out_lengths(fix, geo))
                out.narrow(fix.dim, fix.out_rows[0], fix.out_rows[1] - fix.out_rows[0]).add_(part)
        ctx.save_for_backward(x, weight, *(t for pair in shell for t in pair))
        ctx.geo, ctx.conv, ctx.dtypes, ctx.has_bias, ctx.overlap = geo, conv, dtypes, bias is not None, overlap
        ctx.y_shape = tuple(y.shape)
        return out.to(dtype)  # rounded once, as torch rounds its own

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight, *flat = ctx.saved_tensors
        geo: ShellGeometry = ctx.geo
        stride, dilation, groups = ctx.conv
        shell = [(flat[2 * i], flat[2 * i + 1]) for i in range(len(flat) // 2)]
        grad = grad.to(x.dtype)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gshell = [(torch.zeros_like(a), torch.zeros_like(b)) for a, b in shell] if need_x else None
        # The shell's input gradients first: they go back to their owners while the block's
        # backward runs (overlapped). The block's weight gradient is then the accumulator the
        # corrections' weight gradients are added into, tap by tap (no zeroed weight-sized
        # buffer beside it: for a 512x256x3^3 conv that is 14 MB at the peak). Gradients keep
        # their strides (a reordered thin block's gradient is contiguous once permuted back).
        fixes = []
        for fix in geo.corrections:
            inp, w = _correction_input(fix, shell, weight)
            fixes.append((fix, inp, w, _correction_grad(grad, fix, inp, w, stride, dilation)))
        if gshell is not None:
            for fix, inp, w, g in fixes:
                gi, _ = conv3d_backward(g, inp, w, stride, fix.pads, dilation, groups, (True, False))
                assert gi is not None
                gi = gi.narrow(fix.dim, fix.zeros[0], fix.rows[1] - fix.rows[0])
                piece = _narrowed(gshell[fix.level][fix.side].narrow(fix.dim, fix.rows[0], fix.rows[1] - fix.rows[0]),
                                  fix.narrow)
                piece.add_(gi)
        pending = adds = None
        if gshell is not None:
            if ctx.overlap:
                pending = in_background(reduce_shell, gshell, geo.steps, tuple(x.shape))
            else:
                adds = reduce_shell(gshell, geo.steps, tuple(x.shape))
        try:
            gi, gw = conv3d_backward(_uncrop(grad, ctx.y_shape, geo.offsets), _narrowed(x, geo.core),
                                     weight, stride, geo.pads, dilation, groups, (need_x, need_w))
        finally:
            if pending is not None:
                adds = pending.result()
        if gw is not None:
            for fix, inp, w, g in fixes:
                _, gwp = conv3d_backward(g, inp, w, stride, fix.pads, dilation, groups, (False, True))
                gw.narrow(fix.dim, fix.taps[0], fix.taps[1] - fix.taps[0]).add_(gwp)
        gx = None
        if need_x:
            gx = gi if all(c is None for c in geo.core) else _embed(gi, x, geo.core)
            for idx, t in adds or ():
                gx[idx] += t
            gx = gx.to(ctx.dtypes[0])
        gb = grad.sum((0, 2, 3, 4)).to(ctx.dtypes[2]) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, (gw.to(ctx.dtypes[1]) if gw is not None else None), gb, None, None, None


def _correction_grad(grad: torch.Tensor, fix: Correction, inp: torch.Tensor, w: torch.Tensor,
                     stride: Sequence[int], dilation: Sequence[int]) -> torch.Tensor:
    """The output gradient one correction's convolution sees: the rows it wrote, in zeros
    where its padding made rows the crop dropped."""
    g = grad.narrow(fix.dim, fix.out_rows[0], fix.out_rows[1] - fix.out_rows[0])
    full = list(g.shape)
    for b in range(3):
        if b + 2 != fix.dim:
            full[b + 2] = _conv_len(inp.shape[b + 2], fix.pads[b], w.shape[b + 2], stride[b], dilation[b])
    return _uncrop(g, full, fix.offsets)


def _conv_len(n: int, pad: int, k: int, s: int, d: int) -> int:
    return (n + 2 * pad - d * (k - 1) - 1) // s + 1


def _embed(g: torch.Tensor, x: torch.Tensor, core: Sequence[Span | None]) -> torch.Tensor:
    """The gradient of the block from that of the rows the convolution read (a trimmed block)."""
    full = g.new_zeros(x.shape)
    _narrowed(full, core).copy_(g)
    return full

