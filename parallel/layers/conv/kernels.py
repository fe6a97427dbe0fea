"""The convolution kernels of the spatial layers: ``F.conv3d`` and its backward, with the
spatial dims of thin CPU blocks reordered.

Blocks are thin, and torch's CPU heuristic (``ConvParams::use_mkldnn``) sends a float32
3-D convolution with batch 1, one group and a kernel at most 3 wide to its native
kernel when N*C*D*H <= 20480, counting only the first two spatial dims: a 4x32x128x128
block of the first CosmoFlow conv (split 4 ways along D) takes a vol2col path that is
~40% slower and holds a 226 MB column buffer in the weight gradient, where the same
block laid out with D last goes to oneDNN. The boundary slabs of the overlapped
convolution are thinner still. These functions permute such blocks so that the two
largest dims come first (a convolution's sums do not depend on the order of its spatial
dims) and permute the results back (views; no copy of the output).

On CPUs, torch 2.13's bfloat16/float16 convolution backward returns a wrong weight
gradient (finite garbage up to ~1e36) when a spatial dim of the input is shorter than the
kernel's reach (2 rows, kernel 3, padding 1: a plain ``nn.Conv3d`` under autocast does it
too). Split blocks and the shell's corrections are that thin, so ``conv3d_backward``
computes such cases in float32 and rounds the gradients back (``_cpu_low_precision_thin``).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

_NATIVE_LIMIT = 20480  # torch's threshold on N*C*D*H below which batch-1 CPU convs go native


def thin_order(x: torch.Tensor, weight: torch.Tensor, groups: int) -> tuple[int, int, int] | None:
    """The order of the spatial dims that moves this convolution from torch's native CPU
    kernel to oneDNN, or None where torch already picks oneDNN or no order helps."""
    n, c, *dims = x.shape
    if (x.device.type != "cpu" or x.dtype != torch.float32 or n != 1 or groups != 1
            or n * c * dims[0] * dims[1] > _NATIVE_LIMIT or not torch.backends.mkldnn.is_available()
            or not torch.backends.mkldnn.enabled or (weight.shape[-1] > 3 and weight.shape[-2] > 3)):
        return None
    order = sorted(range(3), key=lambda a: -dims[a])  # the two largest dims first
    if n * c * dims[order[0]] * dims[order[1]] <= _NATIVE_LIMIT:
        return None
    return order[0], order[1], order[2]


def _perms(order: Sequence[int]) -> tuple[tuple[int, ...], list[int]]:
    perm = (0, 1, *(a + 2 for a in order))
    inverse = [0] * 5
    for i, p in enumerate(perm):
        inverse[p] = i
    return perm, inverse


def conv3d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Sequence[int],
           padding: Sequence[int], dilation: Sequence[int], groups: int) -> torch.Tensor:
    """``F.conv3d``, thin CPU blocks reordered (the result is the same tensor, as a view)."""
    order = thin_order(x, weight, groups)
    if order is None:
        return F.conv3d(x, weight, bias, tuple(stride), tuple(padding), tuple(dilation), groups)
    perm, inverse = _perms(order)
    y = F.conv3d(x.permute(perm), weight.permute(perm), bias, tuple(stride[a] for a in order),
                 tuple(padding[a] for a in order), tuple(dilation[a] for a in order), groups)
    return y.permute(inverse)


def _cpu_low_precision_thin(x: torch.Tensor, weight: torch.Tensor, dilation: Sequence[int]) -> bool:
    """A CPU bfloat16/float16 input with a spatial dim shorter than the kernel's reach."""
    return (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)
            and any(n < dilation[a] * (weight.shape[2 + a] - 1) + 1 for a, n in enumerate(x.shape[2:])))


def conv3d_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int],
                    padding: Sequence[int], dilation: Sequence[int], groups: int,
                    need: tuple[bool, bool]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Input and weight gradients of ``conv3d`` (no bias), thin CPU blocks reordered."""
    if _cpu_low_precision_thin(x, weight, dilation):  # torch's wrong CPU kernel (module docstring)
        gi, gw = conv3d_backward(grad.float(), x.float(), weight.float(), stride, padding, dilation, groups, need)
        return (None if gi is None else gi.to(x.dtype)), (None if gw is None else gw.to(weight.dtype))
    order = thin_order(x, weight, groups)
    if order is None:
        gi, gw, _ = torch.ops.aten.convolution_backward(
            grad, x, weight, None, list(stride), list(padding), list(dilation), False, [0, 0, 0], groups,
            [need[0], need[1], False])
        return gi, gw
    perm, inverse = _perms(order)
    gi, gw, _ = torch.ops.aten.convolution_backward(
        grad.permute(perm), x.permute(perm), weight.permute(perm), None, [stride[a] for a in order],
        [padding[a] for a in order], [dilation[a] for a in order], False, [0, 0, 0], groups,
        [need[0], need[1], False])
    return (None if gi is None else gi.permute(inverse)), (None if gw is None else gw.permute(inverse))
