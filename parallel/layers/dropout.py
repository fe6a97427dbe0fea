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

    def _mask(self, shape: tuple[int, ...], like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        keep = 1.0 - self.p
        mask = torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(keep, generator=generator)
        return mask / keep


class SpatialDropout(_SyncedDropout, nn.Dropout):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p == 1.0:
            return x * 0.0
        generator = self.rank_generator if x.dim() == 5 else self.group_generator
        return x * self._mask(tuple(x.shape), x, generator)


class SpatialDropout3d(_SyncedDropout, nn.Dropout3d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p == 1.0:
            return x * 0.0
        return x * self._mask((x.shape[0], x.shape[1], 1, 1, 1), x, self.group_generator)
