"""Constant (and zero, and circular) padding of a spatially split volume.

Padding changes the global size of a dim from ``n`` to ``n + left + right``; each rank
owns the canonical block of the padded dim and fetches the window ``[c - left, e - left)``
of the input, filled with the padding value outside the volume (or wrapped around for
circular padding). Negative padding crops the same way. Dims that are not split are
padded by torch directly.

Reflection and replication padding would need mirrored or edge voxels that the halo
exchange does not provide; they are refused by name (``parallel.parallelize``).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from parallel.layers.base import SpatialMixin
from parallel.split.halo import ExchangePlan, fetch


class _SpatialPad(SpatialMixin):
    mode: Literal["constant", "circular"] = "constant"

    def _pads(self, axis: int) -> tuple[int, int]:
        p = self.padding  # (W left, W right, H left, H right, D left, D right), torch's order
        return int(p[4 - 2 * axis]), int(p[5 - 2 * axis])

    def _geometry(self, dims: tuple[int, int, int]) -> tuple[list[int], list[ExchangePlan | None]]:
        native = [0] * 6
        plans: list[ExchangePlan | None] = []
        for axis in range(3):
            left, right = self._pads(axis)
            if self.grid.spatial[axis] == 1:
                native[4 - 2 * axis], native[5 - 2 * axis] = left, right
                plans.append(None)
                continue
            n = dims[axis]
            bounds = self.output_bounds(axis, n, n + left + right)
            plans.append(self.window_plan(axis, n, [(c - left, e - left) for c, e in bounds], self.mode))
        return native, plans

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = self.global_dims(x)
        native, plans = self.cached(dims, lambda: self._geometry(dims))  # type: ignore[misc]
        value = float(getattr(self, "value", 0.0))
        if any(native):
            x = F.pad(x, native, mode=self.mode, value=value) if self.mode == "constant" else \
                F.pad(x, native, mode=self.mode)
        for axis, plan in enumerate(plans):
            if plan is not None:
                x = fetch(x, axis + 2, plan, value)
        return x


class SpatialConstantPad3d(_SpatialPad, nn.ConstantPad3d):
    """``nn.ConstantPad3d`` (and ``nn.ZeroPad3d``) on this rank's block."""


class SpatialZeroPad3d(_SpatialPad, nn.ZeroPad3d):
    """``nn.ZeroPad3d`` on this rank's block."""


class SpatialCircularPad3d(_SpatialPad, nn.CircularPad3d):
    """``nn.CircularPad3d`` on this rank's block (the volume wraps around, as a periodic box)."""

    mode = "circular"
