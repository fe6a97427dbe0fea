"""Convolution and transposed convolution on a spatially split volume.

Convolution: each rank owns the canonical block of the output; it fetches the input
window that block reads (halos from neighbours, padding at the volume edges, wrapped
around for 'circular'), then runs the plain convolution on it without padding.

Transposed convolution: each rank runs the plain transposed convolution on its input
block; the partial outputs overlap between neighbours and are summed into the owners of
the output blocks (the adjoint of the convolution's halo exchange).

Along dims that are not split, the layer pads natively where torch can.

The convolution itself runs through ``parallel.layers.kernels.conv3d``, which keeps thin
CPU blocks on oneDNN.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from parallel.halo import ExchangePlan, fetch, reduce
from parallel.layers.kernels import conv3d
from parallel.layers.base import SpatialMixin, sliding_windows
from parallel.layers.shellconv import ShellConv, ShellGeometry, shell_geometry
from parallel.partition import DIM_NAMES, SplitError, block_bounds


def conv_pads(conv: nn.Conv3d, axis: int) -> tuple[int, int]:
    """Left and right padding along ``axis``, as torch applies them."""
    if isinstance(conv.padding, str):
        if conv.padding == "valid":
            return 0, 0
        total = conv.dilation[axis] * (conv.kernel_size[axis] - 1)
        return total // 2, total - total // 2
    return conv.padding[axis], conv.padding[axis]


class SpatialConv3d(SpatialMixin, nn.Conv3d):
    """``nn.Conv3d`` on this rank's block; equals the serial layer on the gathered volume.

    The block is convolved in place and the halos' contributions added to the rows that
    read them (``parallel.layers.shellconv``): no copy of the block into a window, forward
    or backward. ``overlap`` runs the halo exchange beside the block's convolution (and the
    halo gradients' beside its backward): True, False, or ``"auto"`` (decided per layer at
    its first forward from ``cost_model``, a ``parallel.plan.Machine``: overlapped where the
    messages take longer than handing them to the halo thread; ``parallelize(...,
    overlap_halo="auto")`` sets both).
    """

    overlap: bool | str = False
    cost_model: Any = None
    overlap_chosen: bool | None = None
    """What ``overlap`` came to at the last geometry (``"auto"`` resolved), for reports."""
    window_hook: Callable[..., Any] | None = None
    """``hook(layer, window, pads)``: the input window the kernel convolves (halos fetched,
    padding materialised along split dims) and the padding it still applies; set by
    ``parallel.kfac``, whose factors need the patches the convolution really reads. The
    shell path never forms the window, so a hooked layer takes the window path."""

    def _geometry(self, dims: tuple[int, int, int], x: torch.Tensor) -> tuple[
            tuple[int, ...], list[ExchangePlan | None], ShellGeometry | None, bool]:
        mode: Literal["constant", "circular"] = "circular" if self.padding_mode == "circular" else "constant"
        pads: list[int] = []
        plans: list[ExchangePlan | None] = []
        out_len, mine, blocks, natives = [], [], [], []
        for axis in range(3):
            n, k = dims[axis], self.kernel_size[axis]
            s, d = self.stride[axis], self.dilation[axis]
            left, right = conv_pads(self, axis)
            natives.append(left)
            m = (n + left + right - d * (k - 1) - 1) // s + 1
            if m < 1:
                raise SplitError(f"{self.where}: input size {n} along dim {DIM_NAMES[axis]} is smaller "
                                 f"than the kernel's reach {d * (k - 1) + 1} (padding {left}+{right})")
            if self.grid.spatial[axis] == 1 and mode == "constant" and left == right:
                pads.append(left)
                plans.append(None)
                out_len.append(m)
                mine.append(None)
                blocks.append((0, n))
                continue
            bounds = self.output_bounds(axis, n, m)
            windows = sliding_windows(bounds, k, s, d, left)
            plans.append(self.window_plan(axis, n, windows, mode))
            pads.append(0)
            pos = self.grid.coords[axis]
            out_len.append(bounds[pos][1] - bounds[pos][0])
            mine.append(windows[pos])
            blocks.append(block_bounds(n, self.grid.spatial[axis])[pos])
        shell = None
        if any(p is not None for p in plans):
            shell = shell_geometry(plans, mine, blocks, natives, out_len, self.kernel_size, self.stride,
                                   self.dilation)
        talks = any(p is not None and not p.is_local for p in plans)
        overlap = self._overlap(shell, x) if talks and shell is not None else False
        self.overlap_chosen = overlap
        return tuple(pads), plans, shell, overlap

    def _overlap(self, shell: ShellGeometry, x: torch.Tensor) -> bool:
        if self.overlap != "auto":
            return bool(self.overlap)
        if self.cost_model is None:
            return False
        from parallel.plan.cost import overlap_pays

        return overlap_pays(self.cost_model, self, shell, tuple(x.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = self.global_dims(x)
        pads, plans, shell, overlap = self.cached((dims, self.overlap), lambda: self._geometry(dims, x))  # type: ignore[misc]
        if shell is not None and self.window_hook is None:
            return ShellConv.apply(x, self.weight, self.bias, shell, (self.stride, self.dilation, self.groups),
                                   overlap)
        for axis, plan in enumerate(plans):
            if plan is not None:
                x = fetch(x, axis + 2, plan, 0.0)
        if self.window_hook is not None:
            self.window_hook(self, x, pads)
        return conv3d(x, self.weight, self.bias, self.stride, pads, self.dilation, self.groups)


class SpatialConvTranspose3d(SpatialMixin, nn.ConvTranspose3d):
    """``nn.ConvTranspose3d`` on this rank's block; overlapping outputs summed into owners."""

    window_hook: Callable[..., Any] | None = None
    """``hook(layer, y, pads, out_pads)``: this rank's partial output before the overlaps are
    summed into their owners, and the padding the kernel applied; set by ``parallel.kfac``,
    which reads the output gradient over that window."""

    def _geometry(self, dims: tuple[int, int, int]) -> tuple[tuple[int, ...], tuple[int, ...], list[ExchangePlan | None]]:
        pads: list[int] = []
        out_pads: list[int] = []
        plans: list[ExchangePlan | None] = []
        for axis in range(3):
            n, k = dims[axis], self.kernel_size[axis]
            s, d = self.stride[axis], self.dilation[axis]
            p, op = self.padding[axis], self.output_padding[axis]
            m = (n - 1) * s - 2 * p + d * (k - 1) + op + 1
            parts = self.grid.spatial[axis]
            if parts == 1:
                pads.append(p)
                out_pads.append(op)
                plans.append(None)
                continue
            if m < parts:
                raise self.split_error(axis, n, m)
            span = d * (k - 1) + 1
            windows = [(a * s - p, (b - 1) * s - p + span) for a, b in block_bounds(n, parts)]
            plans.append(self.window_plan(axis, m, windows, "constant"))
            pads.append(0)
            out_pads.append(0)
        return tuple(pads), tuple(out_pads), plans

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        if output_size is not None:
            raise ValueError(f"{self.where}: output_size is not supported under spatial parallelism; "
                             "set output_padding on the layer instead")
        dims = self.global_dims(x)
        pads, out_pads, plans = self.cached(dims, lambda: self._geometry(dims))  # type: ignore[misc]
        split = any(p is not None for p in plans)
        y = F.conv_transpose3d(x, self.weight, None if split else self.bias, self.stride, pads,
                               out_pads, self.groups, self.dilation)
        if self.window_hook is not None:
            self.window_hook(self, y, pads, out_pads)
        for axis, plan in enumerate(plans):
            if plan is not None:
                y = reduce(y, axis + 2, plan)
        if split and self.bias is not None:
            y = y + self.bias.view(1, -1, 1, 1, 1)
        return y
