"""What one rank computes for each layer under a spatial split: its block in and out, which
dims are split, whether the backward needs the input gradient, and the key of its
measured time."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from parallel.model.trace import Layer


def first_layer(layers: list[Layer], i: int) -> bool:
    """Whether layer ``i`` reads the model input (no input gradient in the backward)."""
    return layers[i].in_shape == layers[0].in_shape and all(
        l.kind in ("other",) and l.in_shape == l.out_shape for l in layers[:i])


def _local(shape: Sequence[int], spatial: Sequence[int]) -> list[int]:
    """Largest block of a (C, D, H, W) tensor split ``spatial`` ways (lower ranks are larger)."""
    return [shape[0], *(math.ceil(n / s) for n, s in zip(shape[1:], spatial))]


def valid(layers: list[Layer], spatial: Sequence[int]) -> bool:
    """Every split 5-D activation has at least one voxel per block along every split dim
    (those after a global pool are whole on every rank: they do not count)."""
    for layer in layers:
        if layer.replicated:
            continue
        for shape in (layer.in_shape,) if layer.out_replicated else (layer.in_shape, layer.out_shape):
            if len(shape) == 4 and any(n < s for n, s in zip(shape[1:], spatial)):
                return False
    return True


@dataclass
class LocalOp:
    """What one rank computes for one layer: its block in and out (per sample), which dims
    are split (a split conv reads a window: its block plus halos, unpadded along those
    dims), whether the backward needs the input gradient, and the timing key."""

    in_local: tuple[int, ...]
    out_local: tuple[int, ...]
    split: tuple[bool, ...]
    input_grad: bool
    flat_split: bool = False   # a Linear on the flattened distributed volume: partial products


def local_ops(layers: list[Layer], spatial: Sequence[int]) -> list[LocalOp]:
    """The rank's share of every layer for a spatial split (the largest block: lower ranks)."""
    ops = []
    flat_local: tuple[int, ...] | None = None
    for i, layer in enumerate(layers):
        five = len(layer.in_shape) == 4 and not layer.replicated  # a replicated layer runs whole
        in_local = tuple(_local(layer.in_shape, spatial)) if five else tuple(layer.in_shape)
        out_local = tuple(_local(layer.out_shape, spatial)) if len(layer.out_shape) == 4 and not \
            layer.out_replicated else tuple(layer.out_shape)
        split = tuple(p > 1 for p in spatial) if five else (False, False, False)
        flat = False
        if five and len(layer.out_shape) == 1:  # Flatten: the next Linear multiplies the block
            flat_local = (math.prod(in_local),) if any(split) else None
        elif layer.kind == "linear" and flat_local is not None:
            in_local, flat, flat_local = flat_local, True, None
        ops.append(LocalOp(in_local, out_local, split, not first_layer(layers, i), flat))
    return ops


def op_key(layer: Layer, op: LocalOp, batch: int) -> str:
    """The key of a layer's measured local time in ``Machine.layer_seconds``."""
    shape = "x".join(map(str, op.in_local))
    split = "".join("1" if s else "0" for s in op.split)
    return f"{layer.spec} | in {batch}x{shape} | split {split}{' flat' if op.flat_split else ''} | grad {int(op.input_grad)}"

