"""Data augmentation of distributed volumes that equals augmenting the whole volume.

A rank holds one block of each sample, so an augmentation that moves voxels (a flip) or
draws a value per voxel (noise) must not depend on how the volume is split:

- ``flip``: the flipped volume's block ``[s, e)`` along a dim is the original's
  ``[n - e, n - s)`` reversed; each rank fetches exactly that window from the ranks that
  own it (the halo module's plans), so uneven splits work as well as even ones.
- ``voxel_noise``: standard normal noise from a counter-based hash of (key, global voxel
  index), so every voxel gets the same value whichever rank holds it.

Both are collective over the spatial group where they communicate (``flip`` along split
dims, ``infer_global_dims`` when no volume is given): every rank of the group must call
them with the same arguments.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from parallel.grid import Grid
from parallel.layers.shapes import infer_global_dims
from parallel.partition import block_bounds
from parallel.split import halo

_MASK32 = 0xFFFFFFFF


def flip(x: torch.Tensor, dims: Sequence[int], grid: Grid,
         volume: tuple[int, int, int] | None = None) -> torch.Tensor:
    """This rank's block of the whole volume flipped along tensor ``dims`` (2, 3, 4).

    ``x`` is the block (N, C, D, H, W) of a volume of global size ``volume`` (found by a
    collective over the spatial group when not given).
    """
    if not dims:
        return x
    if volume is None:
        volume = infer_global_dims(x, grid, "parallel.data.augment.flip")
    for dim in dims:
        if dim not in (2, 3, 4):
            raise ValueError(f"flip: dims must be 2, 3 or 4 (D, H, W) of a 5-D block, got {dim}")
        axis = dim - 2
        parts = grid.spatial[axis]
        if parts > 1:
            n = volume[axis]
            windows = [(n - stop, n - start) for start, stop in block_bounds(n, parts)]
            plan = halo.make_plan(n, grid.line_ranks(dim), grid.coords[axis], windows)
            with torch.no_grad():
                x = halo.fetch(x, dim, plan)
        x = x.flip(dim)
    return x


def _hash32(v: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xor-shift-multiply) on int64 tensors holding values < 2**32.

    Products wrap modulo 2**64 in int64, which keeps their low 32 bits exact.
    """
    v = v ^ (v >> 16)
    v = (v * 0x7FEB352D) & _MASK32
    v = v ^ (v >> 15)
    v = (v * 0x846CA68B) & _MASK32
    return v ^ (v >> 16)


def voxel_noise(key: int, channels: int, block: Sequence[tuple[int, int]], volume: Sequence[int],
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard normal noise (channels, d, h, w) of the block ``[(d0, d1), (h0, h1), (w0, w1)]``
    of a volume of size ``volume``: each voxel's value depends only on ``key``, its channel
    and its global index (Box-Muller on two hashed uniforms)."""
    (d0, d1), (h0, h1), (w0, w1) = block
    D, H, W = (int(v) for v in volume)
    ar = lambda a, b: torch.arange(a, b, dtype=torch.int64, device=device)  # noqa: E731
    c = ar(0, channels)[:, None, None, None]
    index = ((c * D + ar(d0, d1)[:, None, None]) * H + ar(h0, h1)[:, None]) * W + ar(w0, w1)
    k = _hash32(torch.tensor(int(key) & _MASK32, dtype=torch.int64))
    a = _hash32((index * 2) & _MASK32 ^ k)
    b = _hash32((index * 2 + 1) & _MASK32 ^ k)
    u1 = (a.double() + 1.0) / 4294967297.0   # in (0, 1)
    u2 = b.double() / 4294967296.0
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)).float()
