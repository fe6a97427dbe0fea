"""The one tracer: the leaf layers of a serial model with their per-sample shapes, from a
forward on the meta device (no memory, no compute). ``parallel.plan`` costs them;
the training checks (``parallel.train.checks.fit``) check them against
the split.

A global pool (an adaptive pool to 1x1x1) ends the split: its output is the whole tensor
on every rank of the spatial group, and so is everything computed from it alone (a
``Linear`` head, the pointwise convolutions of a squeeze-and-excitation gate). The tracer
follows that through every torch operation of the forward (a ``TorchFunctionMode``), so
those layers are marked ``replicated``: they run as the serial layers, with no split and
no exchange, and their 1x1x1 shapes do not limit the split."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from parallel.split.nested import tensors as _tensors


@dataclass
class Layer:
    """One leaf layer of the serial model, per sample (shapes without the batch dim)."""

    kind: str          # conv, convT, pool, gpool (a global pool), upsample, pad, norm, linear, other
    name: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    params: int
    kernel: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    halo: tuple[int, ...] = ()   # input voxels beyond the block on each side, per dim (D, H, W)
    flops: float = 0.0           # forward multiply-adds x 2, per sample
    spec: str = ""               # the module's repr: its type and settings (the key of its timings)
    block: int = -1              # the activation-checkpointing block it belongs to (parallel.model.recompute)
    module: nn.Module | None = field(default=None, repr=False, compare=False)  # on the meta device
    replicated: bool = False     # its input is whole on every rank (after a global pool): runs as serial
    out_replicated: bool = False  # its output is whole on every rank (a global pool's, or a replicated layer's)


ADAPTIVE = (nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool3d)
PADS = (nn.ConstantPad3d, nn.ZeroPad3d, nn.CircularPad3d, nn.ReflectionPad3d, nn.ReplicationPad3d)


def _whole(tensors: list[torch.Tensor]) -> bool:
    """Whether an operation on these tensors gives a result that is whole on every rank:
    some input is a marked (replicated) tensor and none is a split volume (an unmarked 5-D
    tensor that is not a parameter)."""
    from parallel.layers.replicated import is_replicated

    marked = any(is_replicated(t) for t in tensors)
    return marked and not any(t.dim() == 5 and not is_replicated(t) and not isinstance(t, nn.Parameter)
                              for t in tensors)


class _Replication(TorchFunctionMode):
    """Marks every tensor computed from replicated tensors alone as replicated."""

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tensors = _tensors((args, kwargs or {}))
        if tensors and _whole(tensors):
            from parallel.layers.replicated import mark_replicated

            for t in _tensors(out):
                mark_replicated(t)
        return out


def _halo(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, ...]:
    """Input voxels beyond the block on each side, per dim, of a resampling or padding layer."""
    if isinstance(m, nn.Upsample):
        return (0, 0, 0) if str(m.mode).startswith("nearest") else (1, 1, 1)  # linear: one neighbour
    if isinstance(m, PADS):
        p = m.padding  # (W left, W right, H left, H right, D left, D right)
        return tuple(max(0, int(p[4 - 2 * a]), int(p[5 - 2 * a])) for a in range(3))
    # adaptive pool: a window of about n / m voxels may straddle the block boundary
    return tuple(-(-int(n) // max(int(o), 1)) if o > 1 else 0 for n, o in zip(x.shape[2:], y.shape[2:]))


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
            replicated = _whole([x])
            out_replicated = replicated
            # a replicated layer (after a global pool) keeps its kind, for its compute
            if not replicated and isinstance(m, ADAPTIVE) and y.dim() == 5 and tuple(y.shape[2:]) == (1, 1, 1):
                kind, out_replicated = "gpool", True
                from parallel.layers.replicated import mark_replicated

                mark_replicated(y)
            elif isinstance(m, (nn.Upsample, *PADS, *ADAPTIVE)) and x.dim() == 5:
                kind = "upsample" if isinstance(m, nn.Upsample) else "pad" if isinstance(m, PADS) else "pool"
                halo = _halo(m, x, y)
            elif isinstance(m, (nn.Conv3d, nn.ConvTranspose3d)):
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
                                block_of.get(name, -1), m, replicated, out_replicated))
        return record

    from parallel.model.recompute import block_leaves

    block_of = {name: b for b, names in enumerate(block_leaves(model)) for name in names}
    for name, m in model.named_modules():
        if not list(m.children()):
            hooks.append(m.register_forward_hook(hook(name)))
    try:
        model = model.to("meta")
        with torch.no_grad(), _Replication():
            model(torch.zeros((1, *in_shape), device="meta"))
    finally:
        for h in hooks:
            h.remove()
    return layers

