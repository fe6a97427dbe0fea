"""Hooks that capture each preconditioned layer's statistics during forward and backward.

A forward computes the layer's A part (or keeps its input rows, for linear layers) and
registers a hook on the output; the part is committed together with the G part only when
that hook receives the output gradient. A forward that no backward follows (a check, a
recomputation under activation checkpointing, which never backpropagates through the
recomputed output) therefore leaves nothing behind.

What each layer kind reads, per rank:

- serial ``Conv3d``: its input, padded as the layer pads it (any padding mode);
- ``SpatialConv3d``: the window its kernel convolves (``window_hook``: halos fetched,
  padding materialised along split dims), padded by what the kernel still pads;
- ``ConvTranspose3d`` (both): A from its input block; G from the gradient of its partial
  output (spatial: before the overlaps are summed into owners, ``window_hook``);
- ``Linear``: its (N, features) input and output gradient, raw; ``SpatialLinear``: its
  block, placed into a zero (N, features) row so that a sum over space assembles it (a
  sharded weight held local to the blocks: the block's own features, ``parallel.kfac.local``).

Hooks are closures that look the module up by identity, so a deep copy of the model
(which copies hooks) captures nothing into this optimiser.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parallel.kfac.config import KFACConfig
from parallel.kfac.layers import Layer
from parallel.kfac.lowrank import channel_sketch, patch_sketch
from parallel.kfac.patches import channel_gram, pad_volume, patch_gram, transposed_grad_pads
from parallel.kfac.subsample import output_origin, sampled_window
from parallel.layers.conv.layer import conv_pads


@dataclass
class Capture:
    """One forward's statistics for one layer, waiting for its output gradient."""

    a: torch.Tensor | None = None
    count: int = 0
    rows: int = 0
    grad_pads: list[tuple[int, int]] | None = None
    hooked: bool = False


class Recorder:
    """Forward hooks (and window hooks of spatial layers) on every preconditioned layer."""

    def __init__(self, layers: list[Layer], cfg: KFACConfig, dtype: torch.dtype) -> None:
        self.layers = layers
        self.dtype = dtype
        self.chunk = cfg.chunk_mb * 2**20
        self.every = cfg.position_stride
        self.product = cfg.product_dtype(dtype)
        self.capturing = False
        self.by_id = {id(layer.module): layer for layer in layers}
        self.handles = [layer.module.register_forward_hook(
            lambda m, i, o: self._forward(m, i, o)) for layer in layers]
        self._window = lambda m, *args: self._on_window(m, *args)

    def arm(self, on: bool) -> None:
        """Capture during the next forwards and backwards (a factor-update step) or not.

        Spatial layers get their window hook only while armed: a hooked convolution takes
        the plain path, not the overlapped one.
        """
        self.capturing = on
        for layer in self.layers:
            if hasattr(type(layer.module), "window_hook"):
                # a hierarchical Flatten+Linear keeps its hook: every forward shows it the volume
                keep = layer.kind == "flat" and layer.split is not None
                layer.module.window_hook = self._window if on or keep else None  # type: ignore[assignment]

    def clear(self) -> None:
        for layer in self.layers:
            layer.clear()

    def remove(self) -> None:
        self.arm(False)
        for h in self.handles:
            h.remove()

    def _layer(self, module: nn.Module) -> Layer | None:
        layer = self.by_id.get(id(module))
        if layer is None or layer.module is not module:
            return None
        if not (self.capturing and torch.is_grad_enabled() and module.training):
            layer.pending = None
            return None
        return layer

    # -- forward ----------------------------------------------------------------------
    def _on_window(self, module: nn.Module, t: torch.Tensor, *geometry: Any) -> None:
        seen = self.by_id.get(id(module))
        if seen is not None and seen.kind == "flat":
            seen.see_volume((t.shape[1], *geometry[0]))
        layer = self._layer(module)
        if layer is not None:
            with torch.no_grad():
                self._window_stats(layer, module, t, geometry)

    def _window_stats(self, layer: Layer, module: nn.Module, t: torch.Tensor, geometry: tuple) -> None:
        cap = Capture(rows=t.shape[0])
        if layer.kind == "conv":
            pads = [(p, p) for p in geometry[0]]
            origin = output_origin(module, geometry[1]) if self.every > 1 else (0, 0, 0)
            cap.a, cap.count = self._conv_a(layer, pad_volume(t.detach(), pads), origin)
        elif layer.kind == "convT":
            cap.grad_pads = transposed_grad_pads(geometry[0], geometry[1])
            self._hook_output(layer, cap, t)
        elif layer.own is not None:  # a sharded SpatialLinear: the block's own features (parallel.kfac.local)
            cap.a = t.detach().flatten(1)
        else:  # SpatialLinear: the block in its place in the flattened features
            dims = geometry[0]
            full = t.new_zeros(t.shape[0], t.shape[1], *dims)
            (d0, d1), (h0, h1), (w0, w1) = module.grid.block_range(dims)  # type: ignore[attr-defined]
            full[:, :, d0:d1, h0:h1, w0:w1] = t.detach()
            cap.a = full.flatten(1)
        layer.pending = cap

    def _forward(self, module: nn.Module, inputs: tuple, output: Any) -> None:
        layer = self._layer(module)  # before no_grad: it asks whether grad is enabled
        if layer is not None:
            with torch.no_grad():
                self._forward_stats(layer, module, inputs, output)

    def _forward_stats(self, layer: Layer, module: nn.Module, inputs: tuple, output: Any) -> None:
        cap, layer.pending = layer.pending or Capture(), None
        x = inputs[0].detach()
        cap.rows = x.shape[0]
        if layer.kind == "conv" and cap.a is None:  # a serial layer: pad as it pads
            conv: Any = module
            pads = [conv_pads(conv, axis) for axis in range(3)]
            mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
            cap.a, cap.count = self._conv_a(layer, pad_volume(x, pads, mode))
        elif layer.kind == "convT":
            cap.a, cap.count = self._channels(layer, "A", x)
            if cap.grad_pads is None:
                tconv: Any = module
                cap.grad_pads = transposed_grad_pads(tconv.padding, tconv.output_padding)
        elif layer.kind == "linear":
            if x.dim() != 2:
                raise ValueError(
                    f"K-FAC: layer '{layer.name}' (Linear) got a {x.dim()}-D input {tuple(x.shape)}; it "
                    "preconditions Linear layers on (batch, features) inputs only: exclude it with "
                    f"kfac.exclude=['{layer.name}']")
            cap.a = x
        if not cap.hooked:
            self._hook_output(layer, cap, output)

    def _conv_a(self, layer: Layer, padded: torch.Tensor, origin: tuple[int, int, int] = (0, 0, 0)
                ) -> tuple[torch.Tensor, int]:
        """A's patch sum over the output positions ``kfac.position_stride`` samples (``origin``:
        the global coordinates of the block's first output position)."""
        conv: Any = layer.module
        bias = conv.bias is not None
        if self.every == 1:
            return self._patches(layer, "A", padded, bias)
        view = sampled_window(padded, conv.kernel_size, conv.stride, conv.dilation, origin, self.every)
        if view is None:  # no sampled position in this block
            return torch.zeros(layer.shape("A"), dtype=self.dtype, device=padded.device), 0
        return self._patches(layer, "A", view[0], bias, view[1])

    def _patches(self, layer: Layer, side: str, padded: torch.Tensor, bias: bool,
                 stride: tuple[int, ...] | None = None) -> tuple[torch.Tensor, int]:
        """The patch Gram sum of ``padded`` for factor ``side``, or its sketch if that factor is
        wide (``stride``: the layer's, unless positions are subsampled)."""
        conv: Any = layer.module
        stride = stride or conv.stride
        if layer.wide == side:
            return patch_sketch(padded, conv.kernel_size, stride, conv.dilation, bias, layer.omega,
                                self.dtype, self.chunk)
        return patch_gram(padded, conv.kernel_size, stride, conv.dilation, bias, self.dtype, self.chunk,
                          self.product if side == "A" else None)

    def _channels(self, layer: Layer, side: str, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The channel Gram sum of ``x`` for factor ``side``, or its sketch if that factor is wide."""
        if layer.wide == side:
            return channel_sketch(x, layer.omega, self.dtype)  # type: ignore[arg-type]
        return channel_gram(x, self.dtype)

    def _hook_output(self, layer: Layer, cap: Capture, out: Any) -> None:
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            return
        cap.hooked = True
        out.register_hook(lambda g: self._commit(layer, cap, g))

    # -- backward ---------------------------------------------------------------------
    @torch.no_grad()
    def _commit(self, layer: Layer, cap: Capture, g: torch.Tensor) -> None:
        if cap.a is None:
            return
        if layer.kind in ("linear", "flat"):
            layer.lin_a.append(cap.a)
            layer.lin_g.append(g.detach())
            layer.rows += cap.rows
            return
        if layer.kind == "conv":
            g_gram, _ = self._channels(layer, "G", g)
        else:
            grad = pad_volume(g.detach(), cap.grad_pads or [(0, 0)] * 3)
            g_gram, _ = self._patches(layer, "G", grad, False)
        layer.a_sum = cap.a if layer.a_sum is None else layer.a_sum + cap.a
        layer.g_sum = g_gram if layer.g_sum is None else layer.g_sum + g_gram
        layer.a_count += cap.count
        layer.rows += cap.rows
