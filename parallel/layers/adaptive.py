"""Adaptive average and max pooling on a spatially split volume, any output size.

Output index ``i`` of a dim of ``n`` pooled to ``m`` reads the input window
``[floor(i n / m), ceil((i + 1) n / m))`` (torch's rule). Pooling over a box is the
same as pooling over one dim after another, so the layer works dim by dim, innermost
(W) first, which also makes max pooling pick torch's voxel among equal maxima (the first
in D, H, W order). Along each dim:

- not split: torch's own adaptive pooling along that dim only;
- split, ``m`` at least the number of blocks: each rank owns the canonical block of the
  output, fetches the input windows its outputs read (``parallel.split.halo.fetch``, whose
  backward is its adjoint) and pools each window;
- split, ``m == 1`` (a global pool): each rank reduces its block to one value, the ranks
  of the line exchange those values (a fetch of the whole line of partial results) and
  each reduces them the same way. The result is replicated over the line.

A pool whose split dims all go to 1 returns a tensor replicated over the spatial group
(marked, ``parallel.layers.replicated``), so ``flatten``, ``view``, ``Linear`` and a
classifier head after it run as in the serial model. Mixing the two (split dims pooled to
1 and others kept split) would leave a tensor neither split nor replicated: refused, as
is ``1 < m < blocks``.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parallel.layers.base import SpatialMixin
from parallel.layers.precision import sum_dtype
from parallel.layers.replicated import mark_replicated
from parallel.partition import DIM_NAMES, SplitError
from parallel.split.halo import ExchangePlan, fetch

Step = tuple[Literal["local", "split", "replicated"], int, object]


def adaptive_window(i: int, n: int, m: int) -> tuple[int, int]:
    """The input window ``[start, stop)`` of output ``i`` when ``n`` is pooled to ``m``."""
    return (i * n) // m, -((-(i + 1) * n) // m)


def _sizes(output_size: int | None | Sequence[int | None], dims: Sequence[int]) -> tuple[int, int, int]:
    out = tuple(output_size) if isinstance(output_size, (tuple, list)) else (output_size,) * 3
    return tuple(n if m is None else int(m) for m, n in zip(out, dims))  # type: ignore[return-value]


class _SpatialAdaptivePool(SpatialMixin):
    kind: Literal["avg", "max"] = "avg"

    def _geometry(self, dims: tuple[int, int, int]) -> tuple[list[Step], bool]:
        """One step per dim, W first; and whether the output is replicated."""
        out = _sizes(self.output_size, dims)
        split = [a for a in range(3) if self.grid.spatial[a] > 1]
        to_one = [a for a in split if out[a] == 1]
        if to_one and len(to_one) != len(split):
            kept = [a for a in split if a not in to_one]
            raise SplitError(
                f"{self.where}: output size {out} pools split dim(s) "
                f"{', '.join(DIM_NAMES[a] for a in to_one)} to 1 but keeps split dim(s) "
                f"{', '.join(DIM_NAMES[a] for a in kept)}; the result would be neither split nor "
                "replicated: split only the dims the layer pools to 1, or none of them")
        steps: list[Step] = []
        for axis in (2, 1, 0):
            n, m, parts = dims[axis], out[axis], self.grid.spatial[axis]
            if parts == 1:
                steps.append(("local", axis, m))
            elif m == 1:
                plan = self.window_plan(axis, parts, [(0, parts)] * parts, "constant")
                steps.append(("replicated", axis, (n, plan)))
            else:
                bounds = self.output_bounds(axis, n, m)
                windows = [(adaptive_window(c, n, m)[0], adaptive_window(e - 1, n, m)[1]) for c, e in bounds]
                plan = self.window_plan(axis, n, windows, "constant")
                c, e = bounds[self.grid.coords[axis]]
                lo = windows[self.grid.coords[axis]][0]
                local = [(a - lo, b - a) for a, b in (adaptive_window(i, n, m) for i in range(c, e))]
                steps.append(("split", axis, (plan, local)))
        return steps, bool(to_one)

    def _reduce(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.kind == "max":
            return x.max(dim, keepdim=True).values  # the first maximum, as torch's kernel picks
        # bfloat16/float16 blocks are summed, exchanged and added in float32 (parallel.layers.precision):
        # the partial sums of a global pool rounded rank by rank would round once per rank
        return x.sum(dim, keepdim=True, dtype=sum_dtype(x.dtype))

    def _local(self, x: torch.Tensor, axis: int, m: int) -> torch.Tensor:
        if x.shape[axis + 2] == m:
            return x
        size = list(x.shape[2:])
        size[axis] = m
        if self.kind == "max":
            return F.adaptive_max_pool3d(x, size)
        return F.adaptive_avg_pool3d(x, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self, "return_indices", False):
            raise ValueError(f"{self.where}: return_indices is not supported under spatial parallelism")
        dims = self.global_dims(x)
        steps, replicated = self.cached(dims, lambda: self._geometry(dims))  # type: ignore[misc]
        for how, axis, info in steps:
            dim = axis + 2
            if how == "local":
                x = self._local(x, axis, info)  # type: ignore[arg-type]
            elif how == "split":
                plan, local = info  # type: ignore[misc]
                x = fetch(x, dim, plan)
                parts = [self._reduce(x.narrow(dim, a, k), dim) for a, k in local]
                if self.kind == "avg":
                    parts = [p / k for p, (_, k) in zip(parts, local)]
                x = torch.cat(parts, dim)
            else:
                n, plan = info  # type: ignore[misc]
                line: ExchangePlan = plan
                x = self._reduce(fetch(self._reduce(x, dim), dim, line), dim)
                if self.kind == "avg":
                    x = x / n
        return mark_replicated(x) if replicated else x


class SpatialAdaptiveAvgPool3d(_SpatialAdaptivePool, nn.AdaptiveAvgPool3d):
    """``nn.AdaptiveAvgPool3d`` on this rank's block; a global pool returns a replicated tensor."""

    kind = "avg"


class SpatialAdaptiveMaxPool3d(_SpatialAdaptivePool, nn.AdaptiveMaxPool3d):
    """``nn.AdaptiveMaxPool3d`` on this rank's block (torch's choice among equal maxima)."""

    kind = "max"

