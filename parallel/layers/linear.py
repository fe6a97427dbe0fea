"""Flatten followed by Linear, without gathering the activations.

The serial ``Linear(Flatten(x))`` multiplies the whole flattened volume by the weight.
Each rank multiplies its block by the matching columns of the weight (viewed as
(out, C, D, H, W)); one all-reduce over the spatial group sums the partial products. The
result is replicated on every rank of the group.

The weight is *sharded* by block: each rank keeps only its block's columns as the parameter,
``(out, C x block voxels)``. ``parallelize(..., input_shape=...)`` (as the training loop and
the benchmarks call it) shards it at once; without ``input_shape`` it is sharded at the
model's first forward on a split block, when the volume is known, before any layer runs
(``parallel.model.flatshard``), or, for a model the meta device cannot trace, at this layer's
first forward (``shard_pending``). The
parameter object stays the same (its data is replaced), so an optimiser built before that
forward holds the shard; optimiser state that already has the whole shape (loaded before
the first forward) is cut at the next ``step`` (``_cut_stale_state``), and the model's
gradient sync is rebuilt for the sharded parameter (``on_shard``). So
the weight, its gradient and the optimiser's state per rank fall by the split. The
gradient of those columns is complete on the rank that owns them (the partial products'
all-reduce hands every rank the whole output gradient), so the gradient sync only averages
it over the data group. ``state_dict`` still holds the serial model's whole tensor: the
columns are gathered over the spatial group (a collective: every rank of the group calls
it), and ``load_state_dict`` takes the whole tensor (or this rank's shard) and keeps the
block's columns. With ``shard_linear=False``, or where K-FAC reads the whole weight
(``window_hook``; ``keeps_whole``: K-FAC's hierarchical form local to the blocks reads the
shard), the weight stays whole, every rank's gradient is non-zero only in its
columns, and the gradient sync's spatial sum assembles it.

After a global pool the features are replicated, not split: Flatten and Linear then run
as the serial layers on every rank (``parallel.layers.replicated``).
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from parallel import comm
from parallel.comm import all_reduce_sum
from parallel.layers.base import SpatialMixin
from parallel.layers.precision import compute_dtypes
from parallel.layers.replicated import is_replicated

Span = tuple[int, int]
log = logging.getLogger("parallel")


class SpatialFlatten(SpatialMixin, nn.Flatten):
    """Passes the 5-D block through: the following ``SpatialLinear`` needs its shape.
    A replicated tensor (after a global pool) is flattened as in the serial model."""

    feeds_linear: bool = True  # False: a Flatten with no Linear after it (set by parallelize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_replicated(x) or x.dim() != 5:
            return super().forward(x)
        if not self.feeds_linear:
            raise NotImplementedError(
                f"{self.where}: flattening a split 5-D block is only supported as Flatten(start_dim=1) directly "
                "followed by a Linear in an nn.Sequential (partial product + all-reduce), or after a global pool "
                f"(a replicated tensor); got a block of shape {tuple(x.shape)}")
        return x


@dataclass(frozen=True)
class Shard:
    """Which columns of the serial weight a rank keeps: the flattened (C, D, H, W) volume's
    block ``ranges`` (this rank's, per spatial dim)."""

    channels: int
    dims: tuple[int, int, int]
    ranges: tuple[Span, Span, Span]

    @property
    def columns(self) -> int:
        return self.channels * (self.ranges[0][1] - self.ranges[0][0]) * (self.ranges[1][1] - self.ranges[1][0]) \
            * (self.ranges[2][1] - self.ranges[2][0])


def _block_view(full: torch.Tensor, channels: int, dims: tuple[int, int, int], ranges: tuple[Span, ...]
                ) -> torch.Tensor:
    """The block's columns of a whole (out, C*D*H*W) tensor, as (out, C, bd, bh, bw)."""
    (d0, d1), (h0, h1), (w0, w1) = ranges
    return full.view(full.shape[0], channels, *dims)[:, :, d0:d1, h0:h1, w0:w1]


class SpatialLinear(SpatialMixin, nn.Linear):
    """``nn.Linear`` applied to the flattened distributed volume (partial product + sum)."""

    window_hook: Callable[..., Any] | None = None
    """``hook(layer, block, dims)``: this rank's block and the global (D, H, W); set by
    ``parallel.kfac``, which assembles the flattened features (a whole weight) or keeps the
    block's own (a sharded one: its hierarchical form local to the blocks)."""
    shard: Shard | None = None
    """Set by ``shard_weight``: the weight parameter holds only these columns."""
    flatten_name: str = ""
    """The Flatten before this layer (its input's shape decides the shard; set by parallelize)."""
    shard_pending: bool = False
    """Shard the weight at the first forward on a split block (parallelize without input_shape)."""
    on_shard: Callable[[], None] | None = None
    """Called after the weight was sharded at a forward (``ParallelModule`` rebuilds its gradient sync)."""
    shard_policy: Callable[[nn.Module, tuple[int, ...]], bool] | None = None
    """``policy(layer, (C, D, H, W))``: whether to shard for that flattened volume (set by
    ``parallelize``'s ``shard_linear`` policy, or by ``parallel.kfac`` where it reads the
    shard); None: shard unless a ``window_hook`` reads the whole weight."""

    def keeps_whole(self, shape: tuple[int, ...]) -> bool:
        """Whether the weight stays whole for a flattened (C, D, H, W) ``shape``."""
        if self.shard_policy is not None:
            return not self.shard_policy(self, shape)
        return self.window_hook is not None

    # -- the shard ------------------------------------------------------------------------
    def shard_weight(self, channels: int, dims: tuple[int, int, int]) -> None:
        """Keep only this rank's columns of the (whole, replicated) weight as the parameter."""
        if channels * dims[0] * dims[1] * dims[2] != self.in_features:
            raise ValueError(f"{self.where}: the flattened volume {channels}x{dims[0]}x{dims[1]}x{dims[2]} has "
                             f"{channels * dims[0] * dims[1] * dims[2]} features but the layer takes {self.in_features}")
        # convert() shares the serial layer's dicts: give this layer its own before changing them.
        self._parameters = OrderedDict(self._parameters)
        self._state_dict_hooks = OrderedDict(self._state_dict_hooks)
        self._load_state_dict_pre_hooks = OrderedDict(self._load_state_dict_pre_hooks)
        self.shard = Shard(channels, dims, self.grid.block_range(dims))  # type: ignore[arg-type]
        self.shard_pending = False
        weight = self.weight
        grad, weight.grad = weight.grad, None
        # The same parameter object, its data replaced: an optimiser that already holds it
        # (built before a first-forward shard) then holds the shard. The whole data is freed.
        with torch.no_grad():
            weight.data = self.cut(weight.detach())  # type: ignore[assignment]
        if grad is not None and bool(grad.any()):  # a gradient accumulated before: its columns
            weight.grad = self.cut(grad)
        weight.spatial_shard = True  # type: ignore[attr-defined]  # the gradient sync's cue
        weight.spatial_shard_layer = weakref.ref(self)  # type: ignore[attr-defined]  # _cut_stale_state's
        _watch_optimizers()
        self.register_state_dict_post_hook(_gather_hook)
        self.register_load_state_dict_pre_hook(_cut_hook)

    def cut(self, full: torch.Tensor) -> torch.Tensor | None:
        """This rank's columns of a whole ``(out, in_features)`` tensor, contiguous
        ``(out, columns)``; None before ``shard_weight``."""
        if self.shard is None:
            return None
        s = self.shard
        return _block_view(full, s.channels, s.dims, s.ranges).reshape(full.shape[0], -1).clone()

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        """The whole ``(out, in_features)`` tensor from every spatial rank's ``(out, columns)``
        (a collective over the spatial group)."""
        s = self.shard
        assert s is not None
        parts = comm.all_gather_varlen(part.detach().contiguous(), self.grid.spatial_group,
                                       caller=f"{self.where}: gathering the sharded weight")
        full = part.new_zeros(part.shape[0], self.in_features)
        for spatial_rank, p in enumerate(parts):
            ranges = self.grid.block_range(s.dims, self.grid.spatial_coords(spatial_rank))
            block = _block_view(full, s.channels, s.dims, ranges)
            block.copy_(p.reshape(block.shape))
        return full

    # -- the layer --------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Replicated features (after a global pool) take the serial layer: flattened, or a whole
        # (N, C, 1, 1, 1) whose mark an out-of-place op dropped (a split block is always smaller).
        if x.dim() != 5:
            return self._replicated(x)
        if x[0].numel() == self.in_features:
            return self._replicated(x.flatten(1))
        dims = self.global_dims(x)
        c = x.shape[1]
        if c * dims[0] * dims[1] * dims[2] != self.in_features:
            raise ValueError(
                f"{self.where}: the flattened volume has {c}x{dims[0]}x{dims[1]}x{dims[2]} = "
                f"{c * dims[0] * dims[1] * dims[2]} features but the layer takes {self.in_features}")
        if self.shard is None and self.shard_pending:
            self._shard_at_forward(c, dims)
        if self.shard is not None:
            if (c, dims) != (self.shard.channels, self.shard.dims):
                raise ValueError(f"{self.where}: its weight is sharded for a {self.shard.channels}x"
                                 f"{'x'.join(map(str, self.shard.dims))} volume, got {c}x{'x'.join(map(str, dims))}")
            if self.window_hook is not None:  # K-FAC's hierarchical form local to the blocks
                self.window_hook(self, x, dims)
            weight = self.weight
        else:
            if self.window_hook is not None:
                self.window_hook(self, x, dims)
            ranges = self.cached(("range", dims), lambda: self.grid.block_range(dims))
            block = _block_view(self.weight, c, dims, ranges)  # type: ignore[arg-type]
            weight = block.reshape(self.out_features, -1)
        return self._summed(x.flatten(1), weight)

    def _summed(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The partial product of this rank's columns, summed over the spatial group, plus the
        bias. Under bfloat16/float16 (autocast, or inputs of that dtype) the partials are formed
        from the rounded inputs in float32 (the products of rounded values are exact there),
        summed across ranks in float32 and rounded once, as the serial layer rounds its
        float32 accumulation once (``parallel.layers.precision``); the backward follows in
        float32 and rounds the input gradient once."""
        dtype, work = compute_dtypes(x)
        if work == dtype:
            y = all_reduce_sum(F.linear(x, weight), self.grid.spatial_group)
            return y if self.bias is None else y + self.bias
        with torch.autocast(x.device.type, enabled=False):
            partial = F.linear(x.to(dtype).to(work), weight.to(dtype).to(work))
            y = all_reduce_sum(partial, self.grid.spatial_group)
            if self.bias is not None:
                y = y + self.bias.to(dtype).to(work)
            return y.to(dtype)

    def _shard_at_forward(self, channels: int, dims: tuple[int, int, int]) -> None:
        """The first forward on a split block: the volume is known now, shard the weight."""
        self.shard_pending = False
        if self.keeps_whole((channels, *dims)):  # K-FAC assembles the features against the whole weight
            log.info("%s: weight kept whole (K-FAC reads the whole weight)", self.where)
            return
        self.shard_weight(channels, dims)
        log.debug("%s: weight sharded at the first forward, %d of %d columns", self.where, self.weight.shape[1],
                  self.in_features)
        if self.on_shard is not None:
            self.on_shard()

    def _replicated(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard is not None:
            raise ValueError(f"{self.where}: its weight is sharded for a split {self.shard.channels}x"
                             f"{'x'.join(map(str, self.shard.dims))} volume but got replicated features "
                             f"{tuple(x.shape)}")
        return super().forward(x)


def _gather_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``state_dict`` holds the serial model's whole weight (gathered: collective)."""
    assert isinstance(module, SpatialLinear)
    key = prefix + "weight"
    if key in state_dict and module.shard is not None:
        state_dict[key] = module.gather(state_dict[key])


def _cut_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """A whole weight (a checkpoint of any grid, the serial model's) loads as this rank's columns."""
    assert isinstance(module, SpatialLinear)
    key = prefix + "weight"
    value = state_dict.get(key)
    if isinstance(value, torch.Tensor) and module.shard is not None and \
            tuple(value.shape) == (module.out_features, module.in_features):
        state_dict[key] = module.cut(value)


# -- optimiser state of sharded weights (the training state's checkpoints) --------------------

def _pairs(optimizer: torch.optim.Optimizer, sd: dict[str, Any], model: nn.Module
           ) -> list[tuple[int, nn.Parameter, SpatialLinear]]:
    """(state id, parameter, layer) of every sharded weight the optimiser holds."""
    owners = {id(m.weight): m for m in model.modules() if isinstance(m, SpatialLinear) and m.shard is not None}
    out = []
    for group, saved in zip(optimizer.param_groups, sd["param_groups"]):
        for p, pid in zip(group["params"], saved["params"]):
            if id(p) in owners:
                out.append((pid, p, owners[id(p)]))
    return out


def gather_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every sharded weight's per-element state (momentum,
    Adam's moments) gathered whole, as the serial model's optimiser would hold it. A
    collective over the spatial group when the model has a sharded weight."""
    sd = optimizer.state_dict()
    for pid, p, layer in _pairs(optimizer, sd, model):
        if pid not in sd["state"]:
            continue
        state = dict(sd["state"][pid])  # state_dict() shares the optimiser's own dicts: never change them
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(p.shape):
                state[key] = layer.gather(value)
        sd["state"][pid] = state
    return sd


def cut_optimizer_state(sd: dict[str, Any], optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """The inverse for loading: whole per-element state of sharded weights cut to this
    rank's columns (a copy of ``sd``'s state where it changes; no communication)."""
    pairs = _pairs(optimizer, sd, model)
    if not pairs:
        return sd
    sd = {**sd, "state": dict(sd["state"])}
    for pid, p, layer in pairs:
        if pid not in sd["state"]:
            continue
        state = dict(sd["state"][pid])
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and tuple(value.shape) == (layer.out_features, layer.in_features):
                state[key] = layer.cut(value)
        sd["state"][pid] = state
    return sd


def whole(param: torch.Tensor, value: torch.Tensor | None = None) -> torch.Tensor:
    """``value`` (default: the parameter's data; or its gradient, or an optimiser state of its
    shape) as the serial model holds it: gathered over the spatial group where ``param`` is
    a Flatten+Linear weight sharded by block (a collective: every rank of the group calls
    it), else ``value`` itself. Public as ``parallel.whole``: compare a split model's
    parameters or gradients with the serial model's, ``parallel.whole(p, p.grad)``."""
    value = param.detach() if value is None else value
    ref = getattr(param, "spatial_shard_layer", None)
    layer = ref() if ref is not None else None
    return value if layer is None or layer.shard is None else layer.gather(value)


def shard_of(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """This rank's columns of a whole ``value`` where ``param`` is a sharded weight, else ``value``."""
    ref = getattr(param, "spatial_shard_layer", None)
    layer = ref() if ref is not None else None
    return value if layer is None or layer.shard is None else layer.cut(value)  # type: ignore[return-value]


# -- optimiser state of a weight sharded after the optimiser got it ---------------------------

_WATCHING = False


def _watch_optimizers() -> None:
    """Install (once per process) the step pre-hook that cuts stale whole-shaped state."""
    global _WATCHING
    if not _WATCHING:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_cut_stale_state)
        _WATCHING = True


def _cut_stale_state(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before any optimiser's step: per-element state of a sharded weight that still has the
    whole ``(out, in_features)`` shape (an optimiser state loaded before the first forward
    sharded the weight) is cut to this rank's columns, as ``cut_optimizer_state`` would have."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref = getattr(p, "spatial_shard_layer", None)
            layer = ref() if ref is not None else None
            state = optimizer.state.get(p) if layer is not None else None
            if not state:
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and tuple(value.shape) == (layer.out_features, layer.in_features) \
                        and tuple(p.shape) != tuple(value.shape):
                    state[key] = layer.cut(value)
                    log.info("%s: optimiser state %r cut to the weight's shard", layer.where, key)
