"""3D U-Net's sample fields and the normalisation the reader applies to each block.

``image``: (1, D, H, W) float32 intensities; ``label``: (D, H, W) uint8 classes
(0 background, 1 organ/kidney, 2 lesion/tumour); ``fg_boxes``: (2, 8, 7) int32, the
bounding boxes of the largest connected components of each foreground class, which the
training crop (``parallel.data.crops.BalancedCrop``) chooses from without reading the
label (``parallel.data.foreground``). Every case has its own (D, H, W). A file's
``intensity`` attribute says whether the image holds raw CT-like values (``"hu"``:
synthetic data) or values already normalised by the MLPerf KiTS19 preprocessing
(``"normalized"``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np
import torch

from parallel.data.crops import BOX_COLUMNS
from parallel.data.foreground import KEEP, box_problems, foreground_boxes
from parallel.data.format import FieldSpec, SampleSpec

CLASSES = 3
BOXES = "fg_boxes"


def check_boxes(f: Any, deep: bool) -> list[str]:
    """``fg_boxes`` is sound for each case; with ``deep``, equal to the boxes recomputed
    from the label map (a conversion that wrote them from other data is caught)."""
    if BOXES not in f:
        return []  # the per-field check reports the missing field
    shape = tuple(int(n) for n in f.attrs.get("global_shape", f["label"].shape[-3:]))
    problems = []
    for row in range(f[BOXES].shape[0]):
        stored = f[BOXES][row]
        problems += [f"field {BOXES!r} sample {row}: {p}" for p in box_problems(stored, shape, CLASSES)]
        if deep and not problems and "label" in f:
            want = foreground_boxes(f["label"][row], CLASSES, stored.shape[1])
            if not np.array_equal(stored, want):
                problems.append(f"field {BOXES!r} sample {row} does not match the label map's components "
                                f"(stored {stored[:, :2].tolist()}, recomputed {want[:, :2].tolist()}, first two "
                                "boxes per class); convert the case again")
    return problems


SPEC = SampleSpec(
    name="unet3d",
    fields=(
        FieldSpec("image", "float32", kind="volume", channels=1, finite=True),
        FieldSpec("label", "uint8", kind="volume", channels=None, valid_range=(0, 2)),
        FieldSpec(BOXES, "int32", kind="scalar", shape=(CLASSES - 1, KEEP, BOX_COLUMNS)),
    ),
    checks=(check_boxes,),
)
FIELDS = SPEC.names

# The MLPerf KiTS19 preprocessing: clip to these HU bounds, then z-score.
CLIP = (-79.0, 304.0)
MEAN, STD = 101.0, 76.9


def transform(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Clip and z-score a raw (``"hu"``) image block; labels to int64 (D, H, W)."""
    out = dict(sample)
    out["image"] = (sample["image"].float().clamp(*CLIP) - MEAN) / STD
    out["label"] = sample["label"].long()
    return out


def normalized_transform(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """For images already normalised (converted KiTS19): labels to int64 only."""
    out = dict(sample)
    out["label"] = sample["label"].long()
    return out


def transform_for(attrs: Mapping[str, Any]) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The transform for files with these attributes (``BlockDataset(...).attrs``)."""
    return normalized_transform if attrs.get("intensity") == "normalized" else transform
