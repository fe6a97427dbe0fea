"""Normalisation whose statistics span space: BatchNorm3d, InstanceNorm3d, GroupNorm.

Each rank sums its block; the sums are all-reduced over the spatial group (and over the
data groups too for BatchNorm with ``sync_data``). Mean and variance are two reductions
(sum, then sum of squared deviations) in float32, which keeps the variance as accurate as
the serial layer's.

The forward and backward are one autograd function (``_Normalize``), like torch's own
kernels: it keeps only the input (alive anyway, as the previous layer's output) and the
per-channel statistics for the backward, where it recomputes the normalised values and
all-reduces the two sums the input gradient needs. Composed of autograd ops instead, the
layer kept three tensors of the block's size. The affine gradients are each rank's
partial sums, as the gradient sync expects.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from parallel import comm
from parallel.layers.base import SpatialMixin


def _sum_over(t: torch.Tensor, group: Any) -> torch.Tensor:
    """All-reduce (sum) in place over ``group`` where it has more than one rank."""
    if group is not None and comm.group_size(group) > 1:
        comm.all_reduce_(t, group)
    return t


class _Normalize(torch.autograd.Function):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` with the statistics over ``dims`` of
    ``x`` viewed as ``shape`` (groups for GroupNorm) and over the ranks of ``group``;
    returns the output and the (non-differentiable) mean and biased variance."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                shape: tuple[int, ...], dims: tuple[int, ...], count: float, group: Any, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        with torch.autocast(x.device.type, enabled=False):
            xs = x.detach().to(acc).reshape(shape)
            mean = _sum_over(xs.sum(dims, keepdim=True), group) / count
            centred = xs - mean
            var = _sum_over((centred * centred).sum(dims, keepdim=True), group) / count
            rstd = torch.rsqrt(var + eps)
            y = centred.mul_(rstd).reshape(x.shape)
            if weight is not None:
                y = y.mul_(_channel(weight.to(acc))).add_(_channel(bias.to(acc)))  # type: ignore[arg-type, union-attr]
            y = y.to(x.dtype).detach()  # not a view of the reshaped buffer: in-place layers may follow
        ctx.save_for_backward(x, mean, rstd, weight)
        ctx.meta = (shape, dims, count, group, bias is not None)
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple:
        x, mean, rstd, weight = ctx.saved_tensors
        shape, dims, count, group, has_bias = ctx.meta
        acc = mean.dtype
        with torch.autocast(x.device.type, enabled=False):
            g = grad.to(acc)
            xhat = (x.to(acc).reshape(shape) - mean).mul_(rstd)
            gw = gb = None
            channels = (0, 2, 3, 4)
            if weight is not None and ctx.needs_input_grad[1]:
                gw = (g * xhat.reshape(x.shape)).sum(channels).to(weight.dtype)
            if has_bias and ctx.needs_input_grad[2]:
                gb = g.sum(channels).to(weight.dtype)
            gx = None
            if ctx.needs_input_grad[0]:
                gxhat = (g * _channel(weight.to(acc)) if weight is not None else g.clone()).reshape(shape)
                sums = torch.stack([gxhat.sum(dims, keepdim=True), (gxhat * xhat).sum(dims, keepdim=True)])
                s1, s2 = _sum_over(sums, group) / count
                gx = gxhat.sub_(s1).sub_(xhat.mul_(s2)).mul_(rstd).reshape(x.shape).to(x.dtype).detach()
        return gx, gw, gb, None, None, None, None, None


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
            comm.all_reduce_(rows, self.grid.data_group)
            count = float(rows)
        y, mean, var = _Normalize.apply(x, self.weight if self.affine else None, self.bias if self.affine else None,
                                        tuple(x.shape), (0, 2, 3, 4), count, group, self.eps)
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
        y, mean, var = _Normalize.apply(x, self.weight if self.affine else None, self.bias if self.affine else None,
                                        tuple(x.shape), (2, 3, 4), count, self.grid.spatial_group, self.eps)
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
        y, _, _ = _Normalize.apply(x, self.weight if self.affine else None, self.bias if self.affine else None,
                                   (n, g, c // g, *x.shape[2:]), (2, 3, 4, 5), count, self.grid.spatial_group,
                                   self.eps)
        return y

