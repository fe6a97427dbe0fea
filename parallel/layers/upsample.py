"""``nn.Upsample`` on a spatially split volume: every 5-D mode, scale factors and sizes.

The 5-D modes of ``F.interpolate`` (``nearest``, ``nearest-exact``, ``trilinear`` with or
without ``align_corners``, ``area``) are separable: along each dim, output index ``j`` is
a fixed weighted sum of a few input indices. The layer asks torch itself for those
weights, once per global size, by interpolating the identity matrix along that dim with
the layer's own settings (so every rounding rule of torch's index maths, float32 scales
for nearest, clamping at the edges with ``align_corners=False``, is torch's). Then:

- dims that are not split are interpolated by torch directly, in one call;
- along a split dim each rank owns the canonical block of the output, fetches the input
  window its outputs read (one voxel of halo for trilinear, more for ``area``; none, or a
  trimmed block, for nearest) and forms each output as the weighted sum of gathered input
  slices. The backward is autograd's (``index_select``'s adjoint adds into the window)
  followed by the fetch's adjoint, which sends halo gradients back to their owners.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parallel.layers.base import SpatialMixin
from parallel.split.halo import ExchangePlan, fetch

MODES = ("nearest", "nearest-exact", "trilinear", "area")


def _per_dim(v: object, i: int) -> object:
    return v[i] if isinstance(v, (tuple, list)) else v


def interpolation_weights(n: int, m: int, size: int | None, scale: float | None, mode: str,
                          align_corners: bool | None, recompute: bool | None) -> torch.Tensor:
    """The (m, n) matrix that ``F.interpolate`` applies along one dim of ``n`` voxels."""
    eye = torch.eye(n, dtype=torch.float64).view(1, n, n, 1, 1)
    if size is not None:
        out = F.interpolate(eye, size=(size, 1, 1), mode=mode, align_corners=align_corners)
    else:
        out = F.interpolate(eye, scale_factor=(float(scale), 1.0, 1.0), mode=mode,  # type: ignore[arg-type]
                            align_corners=align_corners, recompute_scale_factor=recompute)
    if out.shape[2] != m:
        raise RuntimeError(f"interpolation of {n} voxels gave {out.shape[2]}, expected {m}")
    return out[0, :, :, 0, 0].t().contiguous()


class SpatialUpsample(SpatialMixin, nn.Upsample):
    """``nn.Upsample`` on this rank's block; equals the serial layer on the gathered volume."""

    def _out_size(self, axis: int, n: int) -> int:
        if self.size is not None:
            return int(_per_dim(self.size, axis))  # type: ignore[arg-type]
        return int(math.floor(float(n * float(_per_dim(self.scale_factor, axis)))))  # type: ignore[arg-type]

    def _geometry(self, dims: tuple[int, int, int]) -> tuple[dict, list[tuple[int, ExchangePlan, torch.Tensor,
                                                                                torch.Tensor, bool]]]:
        if self.mode not in MODES:
            raise NotImplementedError(f"{self.where}: mode '{self.mode}' has no spatial-parallel form "
                                      f"(5-D modes: {', '.join(MODES)})")
        sizes: list[int | None] = []
        scales: list[float | None] = []
        steps = []
        for axis in range(3):
            n, m = dims[axis], self._out_size(axis, dims[axis])
            size = m if self.size is not None else None
            scale = None if self.size is not None else float(_per_dim(self.scale_factor, axis))  # type: ignore[arg-type]
            if self.grid.spatial[axis] == 1:
                sizes.append(m)
                scales.append(scale)
                continue
            sizes.append(None)  # filled with the local block size at call time
            scales.append(1.0)
            weights = interpolation_weights(n, m, size, scale, self.mode, self.align_corners,
                                            self.recompute_scale_factor)
            bounds = self.output_bounds(axis, n, m)
            windows = []
            for c, e in bounds:
                cols = weights[c:e].nonzero()[:, 1]
                windows.append((int(cols.min()), int(cols.max()) + 1))
            plan = self.window_plan(axis, n, windows, "constant")
            c, e = bounds[self.grid.coords[axis]]
            lo = windows[self.grid.coords[axis]][0]
            rows = weights[c:e]
            taps = int((rows != 0).sum(1).max())
            index = torch.zeros(e - c, taps, dtype=torch.int64)
            weight = torch.zeros(e - c, taps, dtype=torch.float64)
            for j in range(e - c):
                cols = rows[j].nonzero()[:, 0]
                index[j, :len(cols)] = cols - lo
                weight[j, :len(cols)] = rows[j, cols]
            exact = taps == 1 and bool((weight == 1).all())  # nearest: a pure gather
            steps.append((axis, plan, index, weight, exact))
        native = {"sizes": sizes, "scales": scales}
        return native, steps

    def _native(self, x: torch.Tensor, native: dict) -> torch.Tensor:
        """Interpolate the dims that are not split, in one torch call (split dims kept)."""
        local = tuple(x.shape[2:])
        if self.size is not None:
            size = tuple(local[a] if m is None else m for a, m in enumerate(native["sizes"]))
            if size == local:
                return x
            return F.interpolate(x, size=size, mode=self.mode, align_corners=self.align_corners)
        scales: Sequence[float] = native["scales"]
        if all(s == 1.0 for s in scales):
            return x
        return F.interpolate(x, scale_factor=tuple(scales), mode=self.mode, align_corners=self.align_corners,
                             recompute_scale_factor=self.recompute_scale_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = self.global_dims(x)
        native, steps = self.cached(dims, lambda: self._geometry(dims))  # type: ignore[misc]
        x = self._native(x, native)
        for axis, plan, index, weight, exact in steps:
            dim = axis + 2
            x = fetch(x, dim, plan)
            key = ("taps", dims, axis, x.device, x.dtype)
            idx, w = self.cached(key, lambda: (index.to(x.device), weight.to(x.device, x.dtype)))  # type: ignore[misc]
            if exact:
                x = x.index_select(dim, idx[:, 0])
                continue
            shape = [1] * x.dim()
            shape[dim] = -1
            y = None
            for t in range(idx.shape[1]):
                term = x.index_select(dim, idx[:, t]) * w[:, t].view(shape)
                y = term if y is None else y + term
            x = y  # type: ignore[assignment]
        return x
