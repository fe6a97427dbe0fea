"""Convolution and transposed convolution on a spatially split volume.

Convolution: each rank owns the canonical block of the output; it fetches the input
window that block reads (halos from neighbours, padding at the volume edges, wrapped
around for 'circular'), then runs the plain convolution on it without padding.

Transposed convolution: each rank runs the plain transposed convolution on its input
block; the partial outputs overlap between neighbours and are summed into the owners of
the output blocks (the adjoint of the convolution's halo exchange).

Along dims that are not split, the layer pads natively where torch can.

The convolution itself runs through ``parallel.layers.conv.kernels.conv3d``, which keeps thin
CPU blocks on oneDNN.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from parallel.layers.base import SpatialMixin, sliding_windows
from parallel.layers.conv.kernels import conv3d
from parallel.layers.conv.paths import check_path, faster_path, window_bytes
from parallel.layers.conv.shell import ShellConv, ShellGeometry, shell_geometry
from parallel.partition import DIM_NAMES, SplitError, block_bounds
from parallel.split.halo import ExchangePlan, fetch, reduce

log = logging.getLogger(__name__)


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
    read them (``parallel.layers.conv.shell``): no copy of the block into a window, forward
    or backward. ``overlap`` runs the halo exchange beside the block's convolution (and the
    halo gradients' beside its backward): True, False, or a policy asked per geometry at the
    layer's first forward, ``policy(layer, shell, input_shape) -> bool`` (the planner's
    ``overlap_halo="auto"``, ``parallel.plan.overlap_policy``: overlapped where the messages
    take longer than handing them to the halo thread), handed down by ``parallelize``.
    """

    overlap: bool | Callable[[Any, ShellGeometry, tuple[int, ...]], bool] = False
    overlap_chosen: bool | None = None
    """What ``overlap`` came to at the last geometry (a policy's answer), for reports."""
    path: str = "shell"
    """``"shell"``, ``"window"`` or ``"auto"`` (timed at the first forward per geometry):
    ``parallel.layers.conv.paths``; the overlapped exchange and a hooked layer fix the path."""
    window_limit_bytes: int | None = None
    """The most bytes a window copy may take (None: no limit); larger ones take the shell."""
    path_chosen: str | None = None
    """The path the last forward took, for reports."""
    window_hook: Callable[..., Any] | None = None
    """``hook(layer, window, pads, dims)``: the input window the kernel convolves (halos fetched,
    padding materialised along split dims), the padding it still applies and the global
    input's (D, H, W); set by
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
        if callable(self.overlap):
            return bool(self.overlap(self, shell, tuple(x.shape)))
        return bool(self.overlap)

    def _path(self, x: torch.Tensor, pads: tuple[int, ...], plans: list[ExchangePlan | None],
              shell: ShellGeometry | None, overlap: bool) -> str:
        """The path this geometry takes (``parallel.layers.conv.paths``)."""
        if shell is None or self.window_hook is not None:
            return "window"
        path = check_path(self.path, self.where)
        if overlap or path == "shell":
            return "shell"
        shape = list(x.shape)
        for axis, plan in enumerate(plans):
            if plan is not None:
                shape[axis + 2] = plan.out_len
        if self.window_limit_bytes is not None and window_bytes(x, tuple(shape)) > self.window_limit_bytes:
            return "shell"
        if path == "window":
            return "window"
        cache = self.__dict__.setdefault("_path_cache", {})
        key = (tuple(x.shape), x.dtype, torch.is_autocast_enabled(x.device.type), self.overlap)
        if key not in cache:
            cache[key] = self._measure(x, pads, plans, shell)
        return cache[key]  # type: ignore[no-any-return]

    def _measure(self, x: torch.Tensor, pads: tuple[int, ...], plans: list[ExchangePlan | None],
                 shell: ShellGeometry) -> str:
        xs = x.detach().requires_grad_(True)
        w = self.weight.detach().requires_grad_(True)
        b = None if self.bias is None else self.bias.detach().requires_grad_(True)
        inputs = [t for t in (xs, w, b) if t is not None]

        def run(path: str) -> Callable[[], None]:
            def go() -> None:
                # Identity hooks over any outer ones: inside a checkpointed block (parallel.model.recompute)
                # the trial's own graph keeps its tensors, and the checkpoint counts none of them.
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                    y = self._shell(xs, w, b, shell, False) if path == "shell" else self._window(xs, w, b, pads, plans)
                    torch.autograd.grad(y, inputs, torch.ones_like(y))
            return go
        chosen, secs = faster_path(run("shell"), run("window"), self.grid.spatial_group, x.device)
        log.debug("%s: %s path (shell %.4g s, window %.4g s forward+backward)", self.where, chosen, *secs)
        self.__dict__["path_seconds"] = {"shell": secs[0], "window": secs[1]}
        return chosen

    def _shell(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, shell: ShellGeometry,
               overlap: bool) -> torch.Tensor:
        return ShellConv.apply(x, w, b, shell, (self.stride, self.dilation, self.groups), overlap)

    def _window(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, pads: tuple[int, ...],
                plans: list[ExchangePlan | None], dims: tuple[int, int, int] | None = None) -> torch.Tensor:
        for axis, plan in enumerate(plans):
            if plan is not None:
                x = fetch(x, axis + 2, plan, 0.0, own_grad=True)  # only the convolution reads the window
        if self.window_hook is not None:
            self.window_hook(self, x, pads, dims)
        return conv3d(x, w, b, self.stride, pads, self.dilation, self.groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = self.global_dims(x)
        pads, plans, shell, overlap = self.cached((dims, self.overlap), lambda: self._geometry(dims, x))  # type: ignore[misc]
        self.path_chosen = self._path(x, pads, plans, shell, overlap)
        if self.path_chosen == "shell":
            assert shell is not None
            return self._shell(x, self.weight, self.bias, shell, overlap)
        return self._window(x, self.weight, self.bias, pads, plans, dims)


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
