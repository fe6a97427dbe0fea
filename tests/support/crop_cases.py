"""Rank-side halves of the crop tests (run by RankPool), the tests' own RandBalancedCrop
on a whole label map, written from the reference's description, and the case files they
read (random blobs for a label)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from parallel.data import write_samples
from parallel.data.foreground import foreground_boxes
from parallel.grid import Grid
from unet3d.fields import SPEC


def reference_crop(label: np.ndarray, patch: Sequence[int], oversampling: float,
                   rng: np.random.Generator) -> tuple[int, int, int]:
    """The crop origin RandBalancedCrop picks, from the label itself (in case coordinates).

    Small cases are first edge-padded, centred, to the patch (the MLPerf preprocessing);
    draws: oversampling, class among those present, one of the two largest components'
    boxes, then a shift per dim (none drawn when a range is empty).
    """
    from scipy import ndimage

    before = [max(p - n, 0) // 2 for n, p in zip(label.shape, patch)]
    label = np.pad(label, [(b, max(p - n, 0) - b) for b, n, p in zip(before, label.shape, patch)], mode="edge")

    def draw(n: int) -> int:
        return 0 if n == 0 else int(rng.integers(n))

    if rng.random() < oversampling:
        present = np.unique(label[label > 0])
        if len(present):
            cls = present[draw(len(present))]
            boxes = ndimage.find_objects(ndimage.label(label == cls)[0])
            sizes = [math.prod(s.stop - s.start for s in b) for b in boxes]
            best = [boxes[i] for i in np.argsort(sizes, kind="stable")[-2:]]
            box = best[draw(len(best))]
            origin = []
            for axis, (s, p) in enumerate(zip(box, patch)):
                n = label.shape[axis]
                missing = p - (s.stop - s.start)
                grow = missing > 0
                missing = abs(missing)
                left = draw(missing)
                right = missing - left
                low = max(0, s.start - left) if grow else s.start + left
                high = min(n, s.stop + right) if grow else s.stop - right
                if p - (high - low) > 0 and low != 0:
                    low -= p - (high - low)
                origin.append(low)
            return tuple(o - b for o, b in zip(origin, before))  # type: ignore[return-value]
    return tuple(draw(n - p) - b for n, p, b in zip(label.shape, patch, before))  # type: ignore[return-value]


def read_crops(grid: Grid, files: list[str], crop: Sequence[int], epochs: int, io: str) -> list[tuple]:
    """Every sample's crop over ``epochs``: (epoch, index, region, bytes read) on this rank."""
    from parallel.data import BlockDataset
    from parallel.data.crops import REGION_KEY, BalancedCrop

    ds = BlockDataset(files, fields=("image", "label"), grid=grid, io=io,
                      regions=BalancedCrop(crop, oversampling=0.4, seed=11))
    out = []
    for epoch in range(epochs):
        for index in range(len(ds)):
            sample, nbytes, _ = ds.load((index, epoch))
            want = tuple(b - a for a, b in grid.block_range(crop))
            assert tuple(sample["image"].shape) == (1, *want) and tuple(sample["label"].shape) == want
            out.append((epoch, index, tuple(sample[REGION_KEY].tolist()), nbytes))
    ds.close()
    return out


def blobs(shape: tuple[int, ...], seed: int, touch_border: bool = False) -> np.ndarray:
    """A label map with several components of classes 1 and 2 (some of equal box size)."""
    rng = np.random.default_rng(seed)
    label = np.zeros(shape, np.uint8)
    for _ in range(int(rng.integers(3, 7))):
        size = rng.integers(1, [max(2, n // 3) for n in shape])
        lo = [int(rng.integers(0, n - s + 1)) for n, s in zip(shape, size)]
        if touch_border and rng.random() < 0.5:
            lo[int(rng.integers(3))] = 0
        label[tuple(slice(a, a + s) for a, s in zip(lo, size))] = rng.integers(1, 3)
    return label


def case_file(tmp: Path, name: str, shape: tuple[int, ...], crop=None, codec="none",
              seed=0) -> tuple[Path, np.ndarray, np.ndarray]:
    """A U-Net case of ``shape`` with random blobs for a label, written to ``tmp/name``; (path, image, label)."""
    rng = np.random.default_rng(seed)
    image = rng.normal(size=(1, *shape)).astype(np.float32)
    label = blobs(shape, seed)
    path = write_samples(tmp / name, SPEC, {"image": image[None], "label": label[None],
                                            "fg_boxes": foreground_boxes(label, 3)[None]},
                         splits=[(2, 1, 1), (2, 2, 1)], codec=codec, crop=crop)
    return path, image, label
