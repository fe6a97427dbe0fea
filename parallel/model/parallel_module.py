"""``ParallelModule``: what ``parallelize`` returns, the hybrid-parallel model around the
converted serial one (its own module so that what takes one, ``parallel.verify``, the
K-FAC optimiser, the training checks, need not import ``parallelize``)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from parallel.comm import replicated_grad
from parallel.grid import Grid
from parallel.layers.linear import SpatialLinear
from parallel.layers.replicated import is_replicated
from parallel.layers.shapes import ShapeTracker
from parallel.model.flatshard import flatten_inputs, shard_linears
from parallel.model.gradsync import GradSync
from parallel.split import layout


def _first_volume(args: tuple, kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() == 5:
            return value
    return None


class ParallelModule(nn.Module):
    """The hybrid-parallel model: takes this rank's block, returns this rank's block
    (5-D outputs) or a replicated tensor (outputs with fewer dims, e.g. after
    Flatten+Linear). ``state_dict``/``load_state_dict`` use the serial model's keys."""

    def __init__(self, module: nn.Module, grid: Grid, shapes: ShapeTracker, bucket_mb: float,
                 shape_probe: nn.Module | None = None) -> None:
        super().__init__()
        self.module = module
        self.grid = grid
        self.shapes = shapes
        self.bucket_mb = bucket_mb
        # The serial structure on the meta device (parallel.model.flatshard.structure): traced at the
        # first forward to cut the pending Flatten+Linear weights before any layer runs. Kept
        # out of the module tree (not a submodule: no parameters, no state_dict keys).
        self.__dict__["_shape_probe"] = shape_probe
        self.noise_scale = False  # the hierarchical sync, forming each data group's gradient (measure_noise_scale)
        self.sync = self._grad_sync() if grid.world_size > 1 else None
        self._resharded = False
        for m in module.modules():
            if isinstance(m, SpatialLinear) and m.shard_pending:
                m.on_shard = self._note_reshard

    def _grad_sync(self) -> GradSync:
        grid = self.grid
        data_grads = (getattr(grid, "grad_data_group", None) or grid.data_group) if grid.data_size > 1 else None
        return GradSync(self.module, grid.grad_group, grid.data_size, self.bucket_mb, data_grads,
                        spatial_group=getattr(grid, "grad_spatial_group", None), spatial_size=grid.spatial_size,
                        measure=self.noise_scale)

    def measure_noise_scale(self, on: bool = True) -> bool:
        """Form each data group's gradient in the sync and sum its squared norm
        (``GradSync.small_norm_sq``; ``parallel.model.gradsync``: the hierarchical sync where
        the sample is split), or go back to one all-reduce over every rank. Call it before
        a backward (gradients are dropped). Whether it measures: two or more data groups."""
        self.noise_scale = bool(on)
        if self.sync is None:
            return False
        self.sync.remove()
        for p in self.module.parameters():
            p.grad = None
        self.sync = self._grad_sync()
        return self.sync.measure

    def _note_reshard(self) -> None:
        self._resharded = True

    def _rebuild_sync(self) -> None:
        """A Flatten+Linear weight was sharded in this forward (``SpatialLinear.shard_pending``):
        its gradient now goes in a bucket of its own, averaged over the data group only."""
        self._resharded = False
        if self.sync is None:
            return
        enabled = self.sync.enabled
        self.sync.remove()
        # Gradients accumulated before (under no_sync) move to the new buckets; the old buckets'
        # fresh zeros are dropped first, so the old buffers are freed before the new ones exist.
        kept = {p: p.grad for p in self.module.parameters() if p.grad is not None and bool(p.grad.any())}
        for p in self.module.parameters():
            p.grad = None
        self.sync = None
        self.sync = self._grad_sync()
        self.sync.enabled = enabled
        self.sync.prepare()
        for p, g in kept.items():
            p.grad.copy_(g)  # type: ignore[union-attr]

    channels_last: bool = False
    """Inputs laid out NDHWC before the model (``parallelize(..., channels_last=True)``)."""

    def _shard_before_forward(self, volume: torch.Tensor, dims: Sequence[int]) -> None:
        """The first forward: the sample's global shape is known, so the Flatten+Linear weights
        waiting for it are cut now, before the activations exist (one try: a model the meta
        device cannot run leaves them to cut at their own forward)."""
        probe, self.__dict__["_shape_probe"] = self.__dict__["_shape_probe"], None
        flat = flatten_inputs(probe, (volume.shape[1], *dims))
        if flat and shard_linears(self.module, self.grid, flat, pending_only=True):
            self._rebuild_sync()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        volume = _first_volume(args, kwargs)
        key = None
        if volume is not None and self.grid.spatial_size > 1:
            key = self.shapes.input_dims(volume, "model input")
            if self.__dict__["_shape_probe"] is not None:
                self._shard_before_forward(volume, key)
        if self.sync is not None and torch.is_grad_enabled():
            self.sync.prepare()
        if self.channels_last:
            args = tuple(layout.channels_last(a) if isinstance(a, torch.Tensor) else a for a in args)
            kwargs = {k: layout.channels_last(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        with self.shapes.forward(key):
            out = self.module(*args, **kwargs)
        if self._resharded:
            self._rebuild_sync()
        return self._mark_replicated(out)

    def _mark_replicated(self, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return replicated_grad(out, self.grid) if out.dim() < 5 or is_replicated(out) else out
        if isinstance(out, (tuple, list)):
            return type(out)(self._mark_replicated(o) for o in out)
        if isinstance(out, dict):
            return {k: self._mark_replicated(v) for k, v in out.items()}
        return out

    def fixed_input(self, volume: Sequence[int]) -> contextlib.AbstractContextManager:
        """Inside: every input is a block of a global (D, H, W) ``volume`` (training batches),
        so the forward needs no all-gather of block sizes (``ShapeTracker.fixed``)."""
        return self.shapes.fixed(volume)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside this block syncs them."""
        if self.sync is None:
            yield
            return
        previous, self.sync.enabled = self.sync.enabled, False
        try:
            yield
        finally:
            self.sync.enabled = previous  # self.sync: the one in use now (a forward may have rebuilt it)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The serial model's keys and tensors. A sharded Linear weight is gathered whole: a
        collective over the spatial group, so every rank of the group must call it."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
