"""Dropout whose mask is consistent across a spatial group.

After the Flatten+Linear all-reduce every rank of a spatial group holds the same
activations, so they must drop the same units: replicated inputs (fewer than 5 dims) and
channel dropout (``Dropout3d``, one draw per sample and channel for the whole volume)
draw from a generator seeded identically on all ranks of the group. Element-wise dropout
on a 5-D block draws from a per-rank generator: each rank's voxels are its own.
"""

from __future__ import annotations

import torch
from torch import nn

from parallel.layers.base import SpatialMixin


class _SyncedDropout(SpatialMixin):
    group_generator: torch.Generator
    rank_generator: torch.Generator

    def seed(self, group_seed: int, rank_seed: int, device: torch.device) -> None:
        self.group_generator = torch.Generator(device=device).manual_seed(group_seed)
        self.rank_generator = torch.Generator(device=device).manual_seed(rank_seed)

    def _mask_shape(self, x: torch.Tensor) -> tuple[tuple[int, ...], torch.Generator]:
        """The shape of one mask draw for ``x`` and the generator it draws from."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p == 1.0:
            return x * 0.0
        shape, generator = self._mask_shape(x)
        keep = 1.0 - self.p
        mask = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(keep, generator=generator)
        return x * (mask / keep)


class SpatialDropout(_SyncedDropout, nn.Dropout):
    def _mask_shape(self, x: torch.Tensor) -> tuple[tuple[int, ...], torch.Generator]:
        return tuple(x.shape), self.rank_generator if x.dim() == 5 else self.group_generator


class SpatialDropout3d(_SyncedDropout, nn.Dropout3d):
    def _mask_shape(self, x: torch.Tensor) -> tuple[tuple[int, ...], torch.Generator]:
        return (x.shape[0], x.shape[1], 1, 1, 1), self.group_generator


def generators(module: nn.Module | None) -> list[torch.Generator]:
    """The private generators of ``module``'s dropout layers, in module order: what a
    recomputed block replays (``parallel.model.recompute``) and a checkpoint keeps
    (``parallel.train.persist.rng``)."""
    gens: list[torch.Generator] = []
    for m in (module.modules() if module is not None else ()):
        for name in ("group_generator", "rank_generator"):
            g = getattr(m, name, None)
            if isinstance(g, torch.Generator):
                gens.append(g)
    return gens
