"""Synthetic CT-like cases: two organ ellipsoids (class 1) with lesions (class 2) inside.

Each case: a body ellipsoid in air; two rotated ellipsoidal organs on either side of the
W axis (semi-axes 15-21 % of the side, never overlapping); in each organ a lesion with
probability 3/4 (at least one per case), an ellipsoid of 55-75 % of the organ's smallest
semi-axis, clipped to the organ. Intensities in CT units, varying per case: air -500,
body ~0, organ ~120, lesion ~240 (brighter than the organ, as contrast-enhancing
tumours are, so an organ's rim never looks like a lesion); a smooth multiplicative bias field (+-8 %) and
Gaussian noise (sd 10-20). After the reader's clip-and-z-score the organ-lesion and
lesion-body contrasts are several noise sd wide, and labels follow voxel centres exactly
(no partial-volume blur), so a U-Net can reach a high Dice quickly.

Cases may be boxes of any (D, H, W): every size above scales with the side it lies
along. ``case_shape`` draws a case's sides from a range, as KiTS19's cases differ (after
the MLPerf resampling, from 128 up to several hundred voxels per side).

Masks are computed inside each ellipsoid's bounding box and the image in depth slabs, so
a 512^3 case needs the uint8 label and float32 image plus slab-sized temporaries.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

SLAB_VOXELS = 1 << 22


def case_rng(seed: int, split: int, index: int) -> np.random.Generator:
    """The generator of case ``index`` of ``split`` (0 train, 1 val)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(split), int(index), 3])))


def case_shape(seed: int, split: int, index: int, ranges: Sequence[tuple[int, int]]) -> tuple[int, int, int]:
    """The (D, H, W) of case ``index``: each side uniform over the integers of its
    ``(lo, hi)`` range (inclusive), from a stream of its own (the case's content draws stay
    those of a case of that shape)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(split), int(index), 5])))
    return tuple(int(rng.integers(lo, hi + 1)) for lo, hi in ranges)  # type: ignore[return-value]


def _rotation(rng: np.random.Generator) -> np.ndarray:
    q, r = np.linalg.qr(rng.standard_normal((3, 3)))
    return q * np.sign(np.diag(r))


def _paint(label: np.ndarray, centre: np.ndarray, axes: np.ndarray, rot: np.ndarray, value: int,
           inside: int | None = None) -> int:
    """Set ``label`` to ``value`` inside an ellipsoid (only where it equals ``inside``, when
    given); returns the voxels painted."""
    n = np.array(label.shape)
    reach = float(axes.max())
    lo = np.maximum(np.floor(centre - reach).astype(int), 0)
    hi = np.minimum(np.ceil(centre + reach).astype(int) + 1, n)
    grids = np.meshgrid(*[np.arange(a, b, dtype=np.float32) for a, b in zip(lo, hi)], indexing="ij")
    d = np.stack([g - c for g, c in zip(grids, centre)], axis=-1)
    local = d @ rot.astype(np.float32)  # coordinates along the ellipsoid's axes
    mask = ((local / axes.astype(np.float32)) ** 2).sum(-1) <= 1.0
    box = label[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]]
    if inside is not None:
        mask &= box == inside
    box[mask] = value
    return int(mask.sum())


def case(seed: int, split: int, index: int, size: int | Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Case ``index`` of ``split``: (image (1, D, H, W) float32, label (D, H, W) uint8);
    ``size``: N for an N^3 case, or (D, H, W)."""
    rng = case_rng(seed, split, index)
    shape = (int(size),) * 3 if np.isscalar(size) else tuple(int(s) for s in size)  # type: ignore[arg-type]
    n = np.array(shape)
    label = np.zeros(shape, dtype=np.uint8)
    organs = []
    for side in (0.28, 0.72):
        centre = np.array([0.5, 0.5, side]) * n + rng.uniform(-0.04, 0.04, 3) * n
        axes = rng.uniform(0.15, 0.21, 3) * n
        rot = _rotation(rng)
        _paint(label, centre, axes, rot, 1)
        organs.append((centre, axes, rot))
    with_lesion = rng.uniform(size=2) < 0.75
    if not with_lesion.any():
        with_lesion[rng.integers(2)] = True
    for (centre, axes, rot), has in zip(organs, with_lesion):
        if not has:
            continue
        small = axes.min()
        l_axes = rng.uniform(0.55, 0.75, 3) * small
        direction = rng.standard_normal(3)
        direction /= np.linalg.norm(direction)
        offset = direction * rng.uniform(0.0, 0.8) * max(small - l_axes.max(), 0.0)
        _paint(label, centre + offset, l_axes, _rotation(rng), 2, inside=1)
    means = np.array([0.0 + rng.normal(0, 10), 120.0 + rng.normal(0, 10), 240.0 + rng.normal(0, 12)],
                     dtype=np.float32)
    noise_sd = np.float32(rng.uniform(10.0, 20.0))
    body_axes = rng.uniform(0.44, 0.5, 3) * n
    freq = rng.uniform(0.5, 1.5, 3)
    phase = rng.uniform(0, 2 * np.pi, 3)
    coords = [(np.arange(m, dtype=np.float32) + 0.5 - m / 2) for m in shape]
    waves = [np.float32(0.08 / 3) * np.sin(2 * np.pi * f * (c / m) + p).astype(np.float32)
             for f, c, p, m in zip(freq, coords, phase, shape)]
    image = np.empty((1, *shape), dtype=np.float32)
    step = max(1, SLAB_VOXELS // (shape[1] * shape[2]))
    for d in range(0, shape[0], step):
        z = slice(d, min(d + step, shape[0]))
        lab = label[z]
        slab = means[lab]
        body = ((coords[0][z, None, None] / body_axes[0]) ** 2 + (coords[1][None, :, None] / body_axes[1]) ** 2
                + (coords[2][None, None, :] / body_axes[2]) ** 2) <= 1.0
        slab[(lab == 0) & ~body] = -500.0
        slab *= 1.0 + waves[0][z, None, None] + waves[1][None, :, None] + waves[2][None, None, :]
        slab += rng.standard_normal(slab.shape, dtype=np.float32) * noise_sd
        image[0, z] = slab
    return image, label
