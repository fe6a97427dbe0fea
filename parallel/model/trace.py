"""The one meta-device tracer: a model's forward on the meta device (shapes only, no
memory, no compute), for everything that must know what a network does to a volume
before running it.

- ``meta_copy``: the model's structure with its parameters and buffers on the meta
  device (no copy of their data; the model itself untouched);
- ``meta_forward``: one forward of a meta model on a sample of a given shape, in the
  weights' dtype;
- ``hooked``: forward hooks (or pre-hooks) on the modules a predicate picks, with their
  names, for the length of a ``with`` block;
- ``trace``: the leaf layers with their per-sample shapes, which the planner
  (``parallel.plan``) costs and the training checks (``parallel.train.checks.fit``) check
  against the split.

Its users: the Flatten+Linear weights' cut (``parallel.model.flatshard``), the random
draws' check (``parallel.model.random_draws``), the probe's size (``parallel.verify``),
K-FAC's costs (``parallel.kfac.costs``), the planner and the training checks.

A global pool (an adaptive pool to 1x1x1) ends the split: its output is the whole tensor
on every rank of the spatial group, and so is everything computed from it alone (a
``Linear`` head, the pointwise convolutions of a squeeze-and-excitation gate). ``trace``
follows that through every torch operation of the forward (a ``TorchFunctionMode``), so
those layers are marked ``replicated``: they run as the serial layers, with no split and
no exchange, and their 1x1x1 shapes do not limit the split."""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from parallel.split.nested import tensors as _tensors


def on_meta(model: nn.Module) -> bool:
    """Whether every parameter and buffer of ``model`` is on the meta device."""
    return all(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))


def meta_copy(model: nn.Module) -> nn.Module:
    """The structure of ``model`` with every parameter and buffer on the meta device: a
    copy that shares no data with the model and allocates none (``copy.deepcopy`` with
    the tensors replaced). Raises what the copy raises (a module holding a lock or a file)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def meta_forward(model: nn.Module, in_shape: Sequence[int], batch: int = 1) -> Any:
    """One forward of a meta ``model`` (``meta_copy``) on ``batch`` samples of ``in_shape``
    (C, D, H, W), zeros in the weights' dtype (a float64 network takes float64), without
    autograd; its output. Errors of the forward propagate."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())
    with torch.no_grad():
        return model(torch.zeros((batch, *in_shape), device="meta", dtype=dtype))


@contextlib.contextmanager
def hooked(model: nn.Module, hook: Callable[..., None], pick: Callable[[str, nn.Module], bool] = lambda n, m: True,
           pre: bool = False) -> Iterator[None]:
    """``hook(name, module, inputs, output)`` after the forward of every module ``pick``
    chooses (``pre``: ``hook(name, module, inputs)`` before it), while the block runs."""
    handles = []
    for name, m in model.named_modules():
        if not pick(name, m):
            continue
        if pre:
            handles.append(m.register_forward_pre_hook(lambda mod, inputs, n=name: hook(n, mod, inputs)))
        else:
            handles.append(m.register_forward_hook(lambda mod, inputs, out, n=name: hook(n, mod, inputs, out)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def is_leaf(_name: str, module: nn.Module) -> bool:
    """A module without children (``hooked``'s ``pick`` for leaf layers)."""
    return not list(module.children())


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

    ``in_shape`` is one sample's input (C, D, H, W). A model already on the meta device is
    traced as it is (its own hooks run); any other is traced through a ``meta_copy``. A
    leaf called without a tensor, or returning none, is left out.
    """
    layers: list[Layer] = []

    def record(name: str, m: nn.Module, inputs: tuple, output: Any) -> None:
        x = next((a for a in inputs if isinstance(a, torch.Tensor)), None)
        y = output if isinstance(output, torch.Tensor) else next(
            (o for o in output if isinstance(o, torch.Tensor)), None) if isinstance(output, (tuple, list)) else None
        if x is None or y is None:
            return
        layers.append(_layer(name, m, x, y, block_of.get(name, -1)))

    from parallel.model.recompute import block_leaves

    block_of = {name: b for b, names in enumerate(block_leaves(model)) for name in names}
    dry = model if on_meta(model) else meta_copy(model)
    with hooked(dry, record, is_leaf), _Replication():
        meta_forward(dry, in_shape)
    return layers


def _layer(name: str, m: nn.Module, x: torch.Tensor, y: torch.Tensor, block: int) -> Layer:
    """One traced leaf: its kind, shapes and costs."""
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
    return Layer(kind, name, tuple(x.shape[1:]), tuple(y.shape[1:]), params, kernel, stride, halo, float(flops),
                 " ".join(repr(m).split()), block, m, replicated, out_replicated)
