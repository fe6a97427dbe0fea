"""Per-file jobs of 3D U-Net preparation: synthetic cases and the KiTS19 converter.

Each job writes one sample file atomically (``write_samples``) and returns its bytes.
KiTS19 as MLPerf preprocesses it: ``case_XXXXX_x.npy`` float32 (1, D, H, W) normalised
intensities and ``case_XXXXX_y.npy`` uint8 (1, D, H, W) labels; case shapes differ, so
each file carries its own ``global_shape`` and chunks. Every file also gets ``fg_boxes``,
the foreground components' boxes a training crop chooses from
(``parallel.data.foreground``), computed here once from the whole label map.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from parallel.data.foreground import foreground_boxes
from parallel.data.format import write_samples
from unet3d import synthetic
from unet3d.fields import BOXES, CLASSES, SPEC

log = logging.getLogger(__name__)

Splits = Sequence[Sequence[int]]


def parse_size_range(text: str) -> list[tuple[int, int]]:
    """``"40,64"`` -> [(40, 64)] * 3; ``"40,64,48,64,48,80"`` -> one (lo, hi) per side."""
    try:
        v = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--size-range {text!r}: want LO,HI or DLO,DHI,HLO,HHI,WLO,WHI") from None
    if len(v) == 2:
        v = v * 3
    ranges = [(v[0], v[1]), (v[2], v[3]), (v[4], v[5])] if len(v) == 6 else []
    if not ranges or any(not 1 <= lo <= hi <= 512 for lo, hi in ranges):
        raise argparse.ArgumentTypeError(f"--size-range {text!r}: want LO,HI or DLO,DHI,HLO,HHI,WLO,WHI "
                                         "with 1 <= LO <= HI <= 512")
    return ranges


def parse_crop(text: str) -> list[int]:
    """``"128"`` -> [128] * 3; ``"128,128,96"`` -> per dim."""
    try:
        v = [int(t) for t in text.split(",")]
    except ValueError:
        v = []
    if len(v) == 1:
        v = v * 3
    if len(v) != 3 or min(v) < 1:
        raise argparse.ArgumentTypeError(f"--crop {text!r}: want N or D,H,W (positive)")
    return v


class ConvertError(ValueError):
    """An input file does not have the layout its converter expects."""


def write_synthetic(out: Path, seed: int, split: int, index: int, size: int | Sequence[tuple[int, int]],
                    codec: str, splits: Splits, crop: Sequence[int] | None = None) -> int:
    """Synthetic case ``index`` of ``split`` as one sample file.

    ``size``: N for N^3 cases, or per-dim inclusive ``(lo, hi)`` ranges to draw the
    case's (D, H, W) from (``synthetic.case_shape``). ``crop``: chunk for training crops
    of this size (``parallel.data.format.choose_crop_chunks``) instead of for blocks.
    """
    shape = synthetic.case_shape(seed, split, index, size) if not np.isscalar(size) else size
    image, label = synthetic.case(seed, split, index, shape)
    boxes = foreground_boxes(label, CLASSES)
    write_samples(out, SPEC, {"image": image[None], "label": label[None], BOXES: boxes[None]}, splits, codec,
                  attrs={"source": "synthetic", "seed": seed, "index": index, "intensity": "hu"}, crop=crop)
    return out.stat().st_size


def convert_kits(x_path: Path, y_path: Path, out: Path, codec: str, splits: Splits,
                 crop: Sequence[int] | None = None) -> int:
    """One preprocessed KiTS19 case (``_x.npy`` + ``_y.npy``) into one sample file."""
    x = np.load(x_path, mmap_mode="r", allow_pickle=False)
    y = np.load(y_path, mmap_mode="r", allow_pickle=False)
    if x.ndim != 4 or x.shape[0] != 1 or x.dtype != np.float32:
        raise ConvertError(f"{x_path}: {x.dtype} {x.shape}, want float32 (1, D, H, W)")
    if y.ndim != 4 or y.shape[0] != 1 or y.dtype != np.uint8:
        raise ConvertError(f"{y_path}: {y.dtype} {y.shape}, want uint8 (1, D, H, W)")
    if x.shape != y.shape:
        raise ConvertError(f"{x_path}: image {x.shape} and label {y.shape} differ in shape")
    label = np.asarray(y)
    if label.max(initial=0) >= CLASSES:
        raise ConvertError(f"{y_path}: label values up to {int(label.max())}, want 0..{CLASSES - 1}")
    boxes = foreground_boxes(label[0], CLASSES)
    write_samples(out, SPEC, {"image": np.asarray(x)[None], "label": label, BOXES: boxes[None]}, splits, codec,
                  attrs={"source": str(x_path), "intensity": "normalized"}, crop=crop)
    return out.stat().st_size
