"""Flatten followed by Linear, without gathering the activations.

The serial ``Linear(Flatten(x))`` multiplies the whole flattened volume by the weight.
Each rank multiplies its block by the matching slice of the weight (viewed as
(out, C, D, H, W)); one all-reduce over the spatial group sums the partial products. The
result is replicated on every rank of the group. The weight stays whole (the serial
parameter, so ``state_dict`` keys and the optimiser are unchanged); each rank's gradient
is non-zero only in its slice, and the gradient sync's spatial sum assembles it.

After a global pool the features are replicated, not split: Flatten and Linear then run
as the serial layers on every rank (``parallel.layers.replicated``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from parallel.comm import all_reduce_sum
from parallel.layers.base import SpatialMixin
from parallel.layers.replicated import is_replicated


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


class SpatialLinear(SpatialMixin, nn.Linear):
    """``nn.Linear`` applied to the flattened distributed volume (partial product + sum)."""

    window_hook: Callable[..., Any] | None = None
    """``hook(layer, block, dims)``: this rank's block and the global (D, H, W); set by
    ``parallel.kfac``, which assembles the flattened features."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Replicated features (after a global pool) take the serial layer: flattened, or a whole
        # (N, C, 1, 1, 1) whose mark an out-of-place op dropped (a split block is always smaller).
        if x.dim() != 5:
            return super().forward(x)
        if x[0].numel() == self.in_features:
            return super().forward(x.flatten(1))
        dims = self.global_dims(x)
        c = x.shape[1]
        if c * dims[0] * dims[1] * dims[2] != self.in_features:
            raise ValueError(
                f"{self.where}: the flattened volume has {c}x{dims[0]}x{dims[1]}x{dims[2]} = "
                f"{c * dims[0] * dims[1] * dims[2]} features but the layer takes {self.in_features}")
        if self.window_hook is not None:
            self.window_hook(self, x, dims)
        (d0, d1), (h0, h1), (w0, w1) = self.cached(("range", dims), lambda: self.grid.block_range(dims))  # type: ignore[misc]
        block = self.weight.view(self.out_features, c, *dims)[:, :, d0:d1, h0:h1, w0:w1]
        partial = F.linear(x.flatten(1), block.reshape(self.out_features, -1))
        y = all_reduce_sum(partial, self.grid.spatial_group)
        return y if self.bias is None else y + self.bias
