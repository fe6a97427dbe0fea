"""Where each Flatten+Linear weight is cut: the per-sample shape every ``nn.Flatten`` of
the serial model sees, from a forward on the meta device (no memory, no compute).

``parallelize(..., input_shape=...)`` cuts the weights at once. Without ``input_shape``
the sample's shape is known only at the model's first forward: ``ParallelModule`` then
traces a meta-device copy of the serial model (``structure``, taken before the layers
were converted) and cuts the weights before any layer runs, so the whole weight is freed
before the activations are allocated (at 256^3 CosmoFlow's whole weight is 67 MB per rank,
against its 8 MB shard at 2x2x2). Where the model does not run on the meta device each
Linear cuts its own weight when its forward reaches it (``SpatialLinear.shard_pending``).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from parallel.grid import Grid
from parallel.layers.linear import SpatialLinear
from parallel.model.trace import hooked, meta_copy, meta_forward, on_meta

log = logging.getLogger("parallel")


def flatten_inputs(model: nn.Module, input_shape: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """The per-sample input shape of every ``nn.Flatten`` of the serial ``model`` for a
    sample of ``input_shape`` (C, D, H, W), from a forward on the meta device
    (``parallel.model.trace``: no memory, no compute, the model's own tensors untouched);
    empty where the model cannot run there."""
    found: dict[str, tuple[int, ...]] = {}
    if not any(isinstance(m, nn.Flatten) for m in model.modules()):
        return found

    def record(name: str, _m: nn.Module, inputs: tuple, _out: Any) -> None:
        found.setdefault(name, tuple(inputs[0].shape[1:]))

    try:
        dry = model if on_meta(model) else meta_copy(model)
        with hooked(dry, record, lambda _n, m: isinstance(m, nn.Flatten)):
            meta_forward(dry, input_shape)
    except Exception as err:  # noqa: BLE001 - a model that needs real tensors: its Linear stays whole
        log.info("Linear weights stay whole: the model does not run on the meta device (%s: %s)",
                 type(err).__name__, err)
        found.clear()
    return found


def shard_linears(model: nn.Module, grid: Grid, flat: Mapping[str, tuple[int, ...]], pending_only: bool = False) -> int:
    """Shard each Flatten+Linear weight whose volume is split (not after a global pool);
    ``pending_only``: only those waiting for their first forward; never those that keep their
    weight whole (``SpatialLinear.keeps_whole``: K-FAC reads it whole, or the ``shard_linear``
    policy says so). Returns how many were sharded."""
    count = 0
    for name, m in model.named_modules():
        shape = flat.get(m.flatten_name) if isinstance(m, SpatialLinear) else None
        if shape is None or len(shape) != 4:
            continue
        if pending_only and (not m.shard_pending or m.shard is not None):
            continue
        if m.keeps_whole(shape):  # K-FAC reads the whole weight, or the shard_linear policy says so
            continue
        if any(n < s for n, s in zip(shape[1:], grid.spatial)):  # replicated (a global pool's output)
            continue
        m.shard_weight(shape[0], tuple(shape[1:]))  # type: ignore[arg-type]
        count += 1
        log.debug("%s: weight sharded by block, %d of %d columns", name, m.weight.shape[1], m.in_features)
    return count


def structure(model: nn.Module) -> nn.Module | None:
    """The model's structure on the meta device (``parallel.model.trace.meta_copy``), for
    ``flatten_inputs`` once the sample's shape is known; None where the model cannot be
    copied (its Linear weights then shard at their own first forward)."""
    try:
        return meta_copy(model)
    except Exception as err:  # noqa: BLE001 - e.g. a module holding a lock or a file
        log.info("Linear weights shard at their first forward: the model cannot be copied (%s: %s)",
                 type(err).__name__, err)
        return None
