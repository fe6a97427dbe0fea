"""Regions of a case to read: training crops (RandBalancedCrop) and fixed boxes.

A *region* is a box ``[start, start + size)`` of a case in the case's own voxel
coordinates. It may reach outside the case; the reader then materialises the padding on
the rank that needs it, replicating the nearest border voxel ("edge" padding, centred), as
the MLPerf KiTS19 preprocessing pads cases smaller than 128^3 before any crop. Each rank
reads only its block of the region (``grid.block_range(size)`` shifted by ``start``), so
a crop costs every rank about ``crop / spatial ranks`` of I/O, however large the case.

``BalancedCrop`` reproduces the MLPerf U-Net reference's ``RandBalancedCrop``
(mlcommons/training, image_segmentation/pytorch, ``data_loading/pytorch_loader.py``)
without reading the label: it needs only the bounding boxes of the largest connected
components of each foreground class, which conversion stores in the sample file
(``parallel.data.foreground.foreground_boxes``; the field is ``fg_boxes``). With
probability ``oversampling`` the crop is placed around one of the two largest (by box
volume) components of a foreground class chosen uniformly among those present, otherwise
uniformly. Positions follow the reference's arithmetic exactly, including its quirks
(``random.randrange(n)`` never returns ``n``, so a uniform crop never touches the far
edge; a component larger than the crop gives a crop inside its box, which may hold no
foreground voxel). ``docs/data.md`` lists where this differs from reading the label.

The generator of each crop is seeded by (seed, epoch, sample index) only, so every rank
of every grid draws the same crop for the same sample: the crops do not depend on the
split, the data-parallel size or the order in which workers read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import numpy as np
import torch

REGION_KEY = "_region"
"""Key of the (6,) int64 tensor ``[start_d, start_h, start_w, size_d, size_h, size_w]``
that a dataset with a region policy adds to each sample (what was read)."""

BOX_COLUMNS = 7
"""Columns of a stored foreground box: ``d0, d1, h0, h1, w0, w1, component id`` (-1: none)."""

_CROP_STREAM = 0x63726F70  # "crop": keeps crop draws apart from other streams of the seed


@dataclass(frozen=True)
class Region:
    """The box ``[start, start + size)`` of a case, in the case's voxel coordinates.

    Voxels outside the case take the value of the nearest voxel inside (edge padding).
    """

    start: tuple[int, int, int]
    size: tuple[int, int, int]

    def as_tensor(self) -> torch.Tensor:
        """``[start..., size...]`` as an int64 tensor (what samples carry under ``REGION_KEY``)."""
        return torch.tensor([*self.start, *self.size], dtype=torch.int64)


class RegionPolicy(Protocol):
    """Chooses the region of each sample that the reader returns.

    ``fields``: scalar fields of the sample file the choice needs (read by every rank,
    small); ``region`` gets them for the sample, with the case's (D, H, W).
    """

    fields: tuple[str, ...]

    def region(self, index: int, epoch: int, shape: Sequence[int],
               scalars: Mapping[str, np.ndarray]) -> Region | None:
        ...


def crop_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator of sample ``index``'s crop in ``epoch`` (the same on every rank)."""
    seq = np.random.SeedSequence([int(seed), _CROP_STREAM, int(epoch), int(index)])
    return np.random.Generator(np.random.PCG64(seq))


def pad_before(shape: Sequence[int], size: Sequence[int]) -> tuple[int, int, int]:
    """Voxels of edge padding before the case along each dim when it is smaller than the
    crop: centred, the smaller half first (the reference's ``pad_to_min_shape``)."""
    return tuple(max(int(s) - int(n), 0) // 2 for n, s in zip(shape, size))  # type: ignore[return-value]


def _randrange(rng: np.random.Generator, n: int) -> int:
    """``random.randrange(n)`` as the reference guards it: 0 for n == 0, else [0, n)."""
    return 0 if n == 0 else int(rng.integers(n))


def uniform_origin(frame: Sequence[int], size: Sequence[int], rng: np.random.Generator) -> tuple[int, int, int]:
    """The reference's ``_rand_crop``: per dim ``randrange(frame - size)`` (0 when equal)."""
    return tuple(_randrange(rng, int(f) - int(s)) for f, s in zip(frame, size))  # type: ignore[return-value]


def framed_boxes(boxes: np.ndarray, shape: Sequence[int], frame: Sequence[int]) -> np.ndarray:
    """Boxes (k, 7) of the case moved into the padded frame.

    Edge padding replicates the border faces, so a component touching a border grows to
    the frame's border there; every other box only shifts by the padding before it.
    """
    out = boxes.astype(np.int64).copy()
    for axis, (n, f) in enumerate(zip(shape, frame)):
        before = (int(f) - int(n)) // 2
        lo, hi = out[:, 2 * axis].copy(), out[:, 2 * axis + 1].copy()
        out[:, 2 * axis] = np.where(lo == 0, 0, lo + before)
        out[:, 2 * axis + 1] = np.where(hi == int(n), int(f), hi + before)
    return out


def _adjust(start: int, stop: int, patch: int, n: int, rng: np.random.Generator) -> int:
    """The reference's ``adjust``: a window of ``patch`` around ``[start, stop)`` in [0, n)."""
    diff = patch - (stop - start)
    sign = -1 if diff < 0 else 1
    diff = abs(diff)
    ladj = _randrange(rng, diff)
    hadj = diff - ladj
    low = max(0, start - sign * ladj)
    high = min(n, stop + sign * hadj)
    diff = patch - (high - low)
    if diff > 0 and low != 0:
        low -= diff
    return low


def foreground_origin(frame: Sequence[int], size: Sequence[int], boxes: np.ndarray,
                      rng: np.random.Generator) -> tuple[int, int, int] | None:
    """The reference's ``rand_foreg_cropd`` on stored boxes (classes, k, 7) in frame
    coordinates; None when no class has a component (the caller crops uniformly)."""
    present = [c for c in range(boxes.shape[0]) if (boxes[c, :, 0] >= 0).any()]
    if not present:
        return None
    cls = present[_randrange(rng, len(present))]
    rows = boxes[cls][boxes[cls, :, 0] >= 0]
    volumes = np.prod(rows[:, 1:6:2] - rows[:, 0:6:2], axis=1)
    # np.argsort(volumes)[-2:] as the reference: ascending volume, ties in component order
    top = rows[np.lexsort((rows[:, 6], volumes))[-2:]]
    box = top[_randrange(rng, len(top))]
    return tuple(_adjust(int(box[2 * a]), int(box[2 * a + 1]), int(size[a]), int(frame[a]), rng)
                 for a in range(3))  # type: ignore[return-value]


def balanced_crop(shape: Sequence[int], size: Sequence[int], boxes: np.ndarray | None, oversampling: float,
                  rng: np.random.Generator) -> tuple[Region, bool]:
    """A crop of ``size`` from a case of ``shape`` as RandBalancedCrop chooses it; whether
    it was the foreground kind. ``boxes``: the case's stored foreground boxes, or None."""
    shape = tuple(int(n) for n in shape)
    size = tuple(int(s) for s in size)
    frame = tuple(max(n, s) for n, s in zip(shape, size))
    before = pad_before(shape, size)
    origin = None
    if rng.random() < oversampling and boxes is not None:
        origin = foreground_origin(frame, size, _framed(boxes, shape, frame), rng)
    foreground = origin is not None
    if origin is None:
        origin = uniform_origin(frame, size, rng)
    start = tuple(o - b for o, b in zip(origin, before))
    return Region(start, size), foreground  # type: ignore[arg-type]


def _framed(boxes: np.ndarray, shape: tuple[int, ...], frame: tuple[int, ...]) -> np.ndarray:
    boxes = np.asarray(boxes)
    if boxes.ndim != 3 or boxes.shape[2] != BOX_COLUMNS:
        raise ValueError(f"foreground boxes have shape {boxes.shape}, want (classes, k, {BOX_COLUMNS})")
    if shape == frame:
        return boxes.astype(np.int64)
    out = np.full(boxes.shape, -1, dtype=np.int64)
    for c in range(boxes.shape[0]):
        valid = boxes[c, :, 0] >= 0
        out[c, valid] = framed_boxes(boxes[c, valid], shape, frame)
    return out


class BalancedCrop:
    """RandBalancedCrop as a region policy of ``BlockDataset`` (picklable).

    Args:
        size: the crop (D, H, W), e.g. (128, 128, 128).
        oversampling: probability of a foreground crop (MLPerf: 0.4).
        seed: the job seed; with the epoch and the sample index it seeds each crop.
        boxes_field: the scalar field holding the foreground boxes.
    """

    def __init__(self, size: Sequence[int], oversampling: float = 0.4, seed: int = 0,
                 boxes_field: str = "fg_boxes") -> None:
        self.size = tuple(int(s) for s in size)
        if len(self.size) != 3 or min(self.size) < 1:
            raise ValueError(f"a crop needs three positive sizes (D, H, W), got {list(size)}")
        if not 0.0 <= oversampling <= 1.0:
            raise ValueError(f"oversampling is a probability in [0, 1], got {oversampling}")
        self.oversampling = float(oversampling)
        self.seed = int(seed)
        self.boxes_field = boxes_field
        self.fields = (boxes_field,) if oversampling > 0 else ()

    def region(self, index: int, epoch: int, shape: Sequence[int],
               scalars: Mapping[str, np.ndarray]) -> Region:
        boxes = scalars.get(self.boxes_field) if self.fields else None
        return balanced_crop(shape, self.size, boxes, self.oversampling, crop_rng(self.seed, epoch, index))[0]


class FixedRegion:
    """The same box for every sample (tests, benchmarks); clipped to nothing."""

    fields: tuple[str, ...] = ()

    def __init__(self, start: Sequence[int], size: Sequence[int]) -> None:
        self._region = Region(tuple(int(s) for s in start), tuple(int(s) for s in size))  # type: ignore[arg-type]

    def region(self, index: int, epoch: int, shape: Sequence[int],
               scalars: Mapping[str, np.ndarray]) -> Region:
        return self._region
