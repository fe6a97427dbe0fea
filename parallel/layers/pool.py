"""Max and average pooling on a spatially split volume.

Like convolution, each rank owns the canonical block of the output and fetches the input
window it reads; the window is padded with -inf for max pooling and 0 for average pooling.
Average pooling then divides by the count torch would use (padding counted or not,
``ceil_mode`` windows clipped at the padded edge), worked out per output index.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parallel.layers.base import SpatialMixin, sliding_windows
from parallel.split.halo import ExchangePlan, fetch


def _triple(v: int | Sequence[int]) -> tuple[int, int, int]:
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v, v)  # type: ignore[return-value]


def pool_output_size(n: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """Output length of a pooling window over ``n`` (torch's rule, ceil_mode included)."""
    span = d * (k - 1) + 1
    m = (n + 2 * p - span + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (m - 1) * s >= n + p:
        m -= 1
    return m


class _SpatialPool(SpatialMixin):
    fill: float = 0.0

    def _params(self) -> tuple[tuple[int, int, int], ...]:
        k = _triple(self.kernel_size)
        s = _triple(self.stride if self.stride is not None else self.kernel_size)
        p = _triple(self.padding)
        d = _triple(getattr(self, "dilation", 1))
        return k, s, p, d

    def _geometry(self, dims: tuple[int, int, int]) -> tuple[tuple[int, ...], list[ExchangePlan | None], list[tuple[int, int]]]:
        """Native padding per dim, exchange plans, and this rank's output range per dim."""
        k, s, p, d = self._params()
        pads: list[int] = []
        plans: list[ExchangePlan | None] = []
        ranges: list[tuple[int, int]] = []
        for axis in range(3):
            n = dims[axis]
            m = pool_output_size(n, k[axis], s[axis], p[axis], d[axis], self.ceil_mode)
            bounds = self.output_bounds(axis, n, m)
            ranges.append(bounds[self.grid.coords[axis]])
            if self.grid.spatial[axis] == 1 and not self.ceil_mode:
                pads.append(p[axis])
                plans.append(None)
                continue
            windows = sliding_windows(bounds, k[axis], s[axis], d[axis], p[axis])
            plans.append(self.window_plan(axis, n, windows, "constant"))
            pads.append(0)
        return tuple(pads), plans, ranges

    def _window(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple, tuple[int, int, int]]:
        dims = self.global_dims(x)
        pads, plans, ranges = self.cached(dims, lambda: self._geometry(dims))  # type: ignore[misc]
        for axis, plan in enumerate(plans):
            if plan is not None:
                x = fetch(x, axis + 2, plan, self.fill)
        return x, (pads, ranges), dims


class SpatialMaxPool3d(_SpatialPool, nn.MaxPool3d):
    """``nn.MaxPool3d`` on this rank's block (padding acts as -inf, as in torch)."""

    fill = float("-inf")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.return_indices:
            raise ValueError(f"{self.where}: return_indices is not supported under spatial parallelism")
        k, s, _, d = self._params()
        x, (pads, _), _ = self._window(x)
        return F.max_pool3d(x, k, s, pads, d, ceil_mode=False)


class SpatialAvgPool3d(_SpatialPool, nn.AvgPool3d):
    """``nn.AvgPool3d`` on this rank's block, with torch's divisor at every output voxel."""

    def _divisor(self, dims: tuple[int, int, int], ranges: list[tuple[int, int]], like: torch.Tensor) -> torch.Tensor:
        k, s, p, _ = self._params()
        out = like.new_ones(())
        for axis in range(3):
            n = dims[axis]
            j = torch.arange(*ranges[axis], device=like.device)
            start = j * s[axis] - p[axis]
            end = torch.clamp(start + k[axis], max=n + p[axis])
            if self.count_include_pad:
                count = end - start
            else:
                count = torch.clamp(end, max=n) - torch.clamp(start, min=0)
            shape = [1, 1, 1, 1, 1]
            shape[axis + 2] = -1
            out = out * count.to(like.dtype).view(shape)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, s, _, _ = self._params()
        x, (pads, ranges), dims = self._window(x)
        sums = F.avg_pool3d(x, k, s, pads, ceil_mode=False, count_include_pad=True, divisor_override=1)
        if self.divisor_override:
            return sums / self.divisor_override
        divisor = self.cached(("divisor", dims, sums.dtype, sums.device),
                              lambda: self._divisor(dims, ranges, sums))
        return sums / divisor  # type: ignore[operator]

