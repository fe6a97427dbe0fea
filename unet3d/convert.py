"""Per-file jobs of 3D U-Net preparation: synthetic cases and the KiTS19 converter.

Each job writes one sample file atomically (``write_samples``) and returns its bytes.
KiTS19 as MLPerf preprocesses it: ``case_XXXXX_x.npy`` float32 (1, D, H, W) normalised
intensities and ``case_XXXXX_y.npy`` uint8 (1, D, H, W) labels; case shapes differ, so
each file carries its own ``global_shape`` and chunks.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from parallel.data.format import write_samples
from unet3d import synthetic
from unet3d.fields import SPEC

log = logging.getLogger(__name__)

Splits = Sequence[Sequence[int]]


class ConvertError(ValueError):
    """An input file does not have the layout its converter expects."""


def write_synthetic(out: Path, seed: int, split: int, index: int, size: int, codec: str, splits: Splits) -> int:
    """Synthetic case ``index`` of ``split`` as one sample file."""
    image, label = synthetic.case(seed, split, index, size)
    write_samples(out, SPEC, {"image": image[None], "label": label[None]}, splits, codec,
                  attrs={"source": "synthetic", "seed": seed, "index": index, "intensity": "hu"})
    return out.stat().st_size


def convert_kits(x_path: Path, y_path: Path, out: Path, codec: str, splits: Splits) -> int:
    """One preprocessed KiTS19 case (``_x.npy`` + ``_y.npy``) into one sample file."""
    x = np.load(x_path, mmap_mode="r", allow_pickle=False)
    y = np.load(y_path, mmap_mode="r", allow_pickle=False)
    if x.ndim != 4 or x.shape[0] != 1 or x.dtype != np.float32:
        raise ConvertError(f"{x_path}: {x.dtype} {x.shape}, want float32 (1, D, H, W)")
    if y.ndim != 4 or y.shape[0] != 1 or y.dtype != np.uint8:
        raise ConvertError(f"{y_path}: {y.dtype} {y.shape}, want uint8 (1, D, H, W)")
    if x.shape != y.shape:
        raise ConvertError(f"{x_path}: image {x.shape} and label {y.shape} differ in shape")
    write_samples(out, SPEC, {"image": np.asarray(x)[None], "label": np.asarray(y)}, splits, codec,
                  attrs={"source": str(x_path), "intensity": "normalized"})
    return out.stat().st_size
