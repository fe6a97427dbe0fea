"""The one tracer: the leaf layers of a serial model with their per-sample shapes, from a
forward on the meta device (no memory, no compute). ``parallel.plan`` costs them;
the training pre-flight (``parallel.train.preflight.check_model``) checks them against
the split."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn


@dataclass
class Layer:
    """One leaf layer of the serial model, per sample (shapes without the batch dim)."""

    kind: str          # conv, convT, pool, norm, linear, other
    name: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    params: int
    kernel: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    halo: tuple[int, ...] = ()   # input voxels beyond the block on each side, per dim (D, H, W)
    flops: float = 0.0           # forward multiply-adds x 2, per sample
    spec: str = ""               # the module's repr: its type and settings (the key of its timings)
    block: int = -1              # the activation-checkpointing block it belongs to (parallel.recompute)
    module: nn.Module | None = field(default=None, repr=False, compare=False)  # on the meta device


def trace(model: nn.Module, in_shape: Sequence[int]) -> list[Layer]:
    """The leaf layers of ``model`` with their per-sample shapes (a forward on the meta device).

    ``in_shape`` is one sample's input (C, D, H, W); the model is moved to the meta device.
    A leaf called without a tensor, or returning none, is left out.
    """
    layers: list[Layer] = []
    hooks = []

    def hook(name: str):
        def record(m: nn.Module, inputs: tuple, output: Any) -> None:
            x = next((a for a in inputs if isinstance(a, torch.Tensor)), None)
            y = output if isinstance(output, torch.Tensor) else next(
                (o for o in output if isinstance(o, torch.Tensor)), None) if isinstance(output, (tuple, list)) else None
            if x is None or y is None:
                return
            params = sum(p.numel() for p in m.parameters(recurse=False))
            kind, kernel, stride, halo, flops = "other", (), (), (), 0.0
            if isinstance(m, (nn.Conv3d, nn.ConvTranspose3d)):
                kind = "conv" if isinstance(m, nn.Conv3d) else "convT"
                kernel, stride = tuple(m.kernel_size), tuple(m.stride)
                reach = [d * (k - 1) for k, d in zip(m.kernel_size, m.dilation)]
                halo = tuple((r + 1) // 2 for r in reach) if kind == "conv" else (0, 0, 0)
                per_out = 2 * m.in_channels // m.groups * math.prod(m.kernel_size)
                flops = per_out * (y[0].numel() if kind == "conv" else x[0].numel() * m.out_channels)
            elif isinstance(m, (nn.MaxPool3d, nn.AvgPool3d)):
                kind = "pool"
                k = m.kernel_size if isinstance(m.kernel_size, tuple) else (m.kernel_size,) * 3
                kernel = tuple(k)
                s = m.stride if m.stride is not None else m.kernel_size
                stride = tuple(s) if isinstance(s, tuple) else (s,) * 3
            elif isinstance(m, (nn.BatchNorm3d, nn.InstanceNorm3d, nn.GroupNorm)):
                kind = "norm"
            elif isinstance(m, nn.Linear):
                kind = "linear"
                flops = 2.0 * m.in_features * m.out_features
            layers.append(Layer(kind, name, tuple(x.shape[1:]), tuple(y.shape[1:]), params,
                                kernel, stride, halo, float(flops), " ".join(repr(m).split()),
                                block_of.get(name, -1), m))
        return record

    from parallel.recompute import block_leaves

    block_of = {name: b for b, names in enumerate(block_leaves(model)) for name in names}
    for name, m in model.named_modules():
        if not list(m.children()):
            hooks.append(m.register_forward_hook(hook(name)))
    try:
        model = model.to("meta")
        with torch.no_grad():
            model(torch.zeros((1, *in_shape), device="meta"))
    finally:
        for h in hooks:
            h.remove()
    return layers

