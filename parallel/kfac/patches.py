"""The sums behind the Kronecker factors: Gram matrices of patches and of channel vectors.

A convolution's weight gradient is ``sum over output positions of g a^T``, with ``a`` the
input patch the position reads (channels x kernel offsets, plus a 1 for the bias) and
``g`` the output gradient there; K-FAC approximates its Fisher block by ``A x G`` with
``A = mean of a a^T`` and ``G = sum of g g^T`` per sample (``docs/kfac.md``).

A transposed convolution is the adjoint of a convolution: its weight gradient is
``sum over input positions i of x_i p_i^T``, with ``x_i`` the input channels at ``i`` and
``p_i`` the patch of the (uncropped) output gradient that ``i`` wrote to. Its factors are
therefore ``A = mean of x x^T`` (input channels) and ``G = sum of p p^T`` (output channels x
kernel offsets), both over input positions. Under a spatial split every rank owns its input
positions and holds the output-gradient window they wrote to, so the sums split cleanly.

Patches are views (``Tensor.unfold``); the Gram matrix is accumulated over slabs of output
depth so that no more than ``chunk_bytes`` of patches are copied out at once.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
import torch.nn.functional as F


def pad_volume(x: torch.Tensor, pads: Sequence[tuple[int, int]], mode: str = "constant") -> torch.Tensor:
    """``x`` padded by ``(left, right)`` along D, H, W (negative values crop), in ``mode``."""
    flat: list[int] = []
    for left, right in reversed(list(pads)):
        flat += [left, right]
    if not any(flat):
        return x
    if mode != "constant" and any(p < 0 for p in flat):
        raise ValueError(f"negative padding {list(pads)} is only defined for zero padding")
    return F.pad(x, flat, mode=mode)


def patch_view(x: torch.Tensor, kernel: Sequence[int], stride: Sequence[int],
               dilation: Sequence[int]) -> torch.Tensor:
    """Patches of the (already padded) volume ``x``: (N, C, Do, Ho, Wo, kd, kh, kw), a view."""
    v = x
    for axis in range(3):
        span = dilation[axis] * (kernel[axis] - 1) + 1
        if v.shape[2 + axis] < span:
            raise ValueError(f"a volume of {tuple(x.shape[2:])} is smaller than the kernel's reach along "
                             f"dim {'DHW'[axis]} ({span})")
        v = v.unfold(2 + axis, span, stride[axis])
    return v[..., ::dilation[0], ::dilation[1], ::dilation[2]]


def patch_slabs(x: torch.Tensor, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int],
                dtype: torch.dtype, chunk_bytes: float) -> Iterator[torch.Tensor]:
    """The patches of ``x`` in slabs of output depth: each a (offsets x channels, positions)
    matrix, rows ordered (offset, channel), no more than ``chunk_bytes`` of them at once.

    The patches of a slab are copied one kernel offset at a time (a strided slice per
    offset, which copies far faster than one permute of the 8-D patch view)."""
    v = patch_view(x, kernel, stride, dilation)
    n, c, depth, height, width = v.shape[:5]
    offsets = [(a, b, e) for a in range(v.shape[5]) for b in range(v.shape[6]) for e in range(v.shape[7])]
    k = len(offsets)
    per_slab = max(1, n * height * width * c * k * torch.finfo(dtype).bits // 8)
    step = max(1, int(chunk_bytes // per_slab))
    for d0 in range(0, depth, step):
        d1 = min(depth, d0 + step)
        buf = torch.empty(k, c, n, d1 - d0, height, width, dtype=dtype, device=x.device)
        for i, (a, b, e) in enumerate(offsets):
            buf[i].copy_(v[:, :, d0:d1, :, :, a, b, e].transpose(0, 1))
        yield buf.view(c * k, -1)


def patch_count(x: torch.Tensor, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int]
                ) -> tuple[int, int, int]:
    """(channels, kernel offsets, patches) of the (padded) volume ``x``."""
    v = patch_view(x, kernel, stride, dilation)
    return v.shape[1], v.shape[5] * v.shape[6] * v.shape[7], v.shape[0] * v.shape[2] * v.shape[3] * v.shape[4]


def patch_gram(x: torch.Tensor, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int],
               bias: bool, dtype: torch.dtype, chunk_bytes: float, product_dtype: torch.dtype | None = None
               ) -> tuple[torch.Tensor, int]:
    """``sum over patches of a a^T`` (a = patch, then 1 if ``bias``) and the number of patches.

    ``product_dtype`` (default ``dtype``): the precision the patches are copied out and
    multiplied in (bfloat16 or float16 for speed); each slab's product is added into the
    ``dtype`` sum, and the bias row's patch sums are taken in ``dtype``.

    Rows of ``a`` are ordered (channel, kd, kh, kw), as ``weight.view(out, -1)`` orders them.
    The slabs (``patch_slabs``) come laid out (offset, channel) x positions; the product's
    rows and columns are then reordered to (channel, offset), and the bias row is the patch
    sums, not a column of ones.
    """
    c, k, count = patch_count(x, kernel, stride, dilation)
    dim = c * k
    gram = torch.zeros(dim + int(bias), dim + int(bias), dtype=dtype, device=x.device)
    for rows in patch_slabs(x, kernel, stride, dilation, product_dtype or dtype, chunk_bytes):
        gram[:dim, :dim] += (rows @ rows.t()).view(k, c, k, c).permute(1, 0, 3, 2).reshape(dim, dim)
        if bias:
            sums = rows.sum(1, dtype=dtype).view(k, c).t().reshape(dim)
            gram[:dim, dim] += sums
            gram[dim, :dim] += sums
    if bias:
        gram[dim, dim] = count
    return gram, count


def channel_gram(x: torch.Tensor, dtype: torch.dtype, bias: bool = False) -> tuple[torch.Tensor, int]:
    """``sum over positions (and rows) of v v^T`` for the channel vectors ``v`` of ``x``
    ((N, C, ...) or (N, C)), then 1 appended if ``bias``; and the number of vectors."""
    rows = x.transpose(0, 1).reshape(x.shape[1], -1).to(dtype)
    if bias:
        rows = torch.cat([rows, rows.new_ones(1, rows.shape[1])], dim=0)
    return rows @ rows.t(), rows.shape[1]


def transposed_grad_pads(padding: Sequence[int], output_padding: Sequence[int]) -> list[tuple[int, int]]:
    """Padding that turns a transposed convolution's output gradient into the gradient of its
    uncropped output: ``padding`` cropped both sides, ``output_padding`` added on the right."""
    return [(p, p - op) for p, op in zip(padding, output_padding)]
