"""Normalisation whose statistics span space: BatchNorm3d, InstanceNorm3d, GroupNorm.

Each rank sums its block; the sums are all-reduced over the spatial group (and over the
data groups too for BatchNorm with ``sync_data``), forward and backward: the all-reduce
is differentiable and its backward is its adjoint, so autograd gives the serial input
gradient and each rank's affine gradients are partial sums, as the gradient sync expects.
Mean and variance are two reductions (sum, then sum of squared deviations) in float32,
which keeps the variance as accurate as the serial layer's.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel.comm import all_reduce_sum
from parallel.layers.base import SpatialMixin


def _moments(x: torch.Tensor, dims: tuple[int, ...], count: float | torch.Tensor, group: Any
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Centred ``x``, mean and biased variance over ``dims`` of the distributed tensor."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    mean = all_reduce_sum(x.sum(dims, keepdim=True, dtype=acc), group) / count
    centred = x.to(acc) - mean
    var = all_reduce_sum((centred * centred).sum(dims, keepdim=True), group) / count
    return centred, mean, var


def _channel(v: torch.Tensor | None) -> torch.Tensor | None:
    return None if v is None else v.view(1, -1, 1, 1, 1)


class SpatialBatchNorm3d(SpatialMixin, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` with batch statistics over the whole distributed volume.

    ``sync_data`` (set by ``parallelize``) also reduces over the data groups, so the
    statistics are those of the global batch (like SyncBatchNorm); without it each data
    group normalises its own rows, as DDP does.
    """

    sync_data: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training or self.running_mean is None):
            return super().forward(x)
        group = self.grid.world_group if self.sync_data else self.grid.spatial_group
        count = float(x.shape[0] * math.prod(self.global_dims(x)))
        if self.sync_data and self.grid.data_size > 1:
            rows = torch.tensor([count], dtype=torch.float64, device=x.device)
            dist.all_reduce(rows, group=self.grid.data_group)
            count = float(rows)
        centred, mean, var = _moments(x, (0, 2, 3, 4), count, group)
        y = (centred * torch.rsqrt(var + self.eps)).to(x.dtype)
        if self.affine:
            y = y * _channel(self.weight) + _channel(self.bias)
        if self.training and self.track_running_stats:
            self._update_running(mean.flatten(), var.flatten(), count)
        return y

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, count: float) -> None:
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * (count / max(count - 1.0, 1.0))
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)


class SpatialInstanceNorm3d(SpatialMixin, nn.InstanceNorm3d):
    """``nn.InstanceNorm3d`` with per-sample statistics over the whole distributed volume."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training or not self.track_running_stats):
            return super().forward(x)
        count = float(math.prod(self.global_dims(x)))
        centred, mean, var = _moments(x, (2, 3, 4), count, self.grid.spatial_group)
        y = (centred * torch.rsqrt(var + self.eps)).to(x.dtype)
        if self.affine:
            y = y * _channel(self.weight) + _channel(self.bias)
        if self.training and self.track_running_stats:
            self._update_running(mean.flatten(2).mean(0).flatten(), var.flatten(2).mean(0).flatten(), count)
        return y

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, count: float) -> None:
        # torch's instance_norm updates with momentum (None means 0: no update).
        factor = self.momentum if self.momentum is not None else 0.0
        unbiased = var * (count / max(count - 1.0, 1.0))
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)


class SpatialGroupNorm(SpatialMixin, nn.GroupNorm):
    """``nn.GroupNorm`` on 5-D blocks, statistics over the whole distributed volume."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c = x.shape[:2]
        g = self.num_groups
        count = float(c // g * math.prod(self.global_dims(x)))
        xg = x.reshape(n, g, c // g, *x.shape[2:])
        centred, _, var = _moments(xg, (2, 3, 4, 5), count, self.grid.spatial_group)
        y = (centred * torch.rsqrt(var + self.eps)).to(x.dtype).reshape(x.shape)
        if self.affine:
            y = y * _channel(self.weight) + _channel(self.bias)
        return y

