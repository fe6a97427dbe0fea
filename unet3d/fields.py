"""3D U-Net's sample fields and the normalisation the reader applies to each block.

``image``: (1, D, H, W) float32 intensities; ``label``: (D, H, W) uint8 classes
(0 background, 1 organ/kidney, 2 lesion/tumour). A file's ``intensity`` attribute says
whether the image holds raw CT-like values (``"hu"``: synthetic data) or values already
normalised by the MLPerf KiTS19 preprocessing (``"normalized"``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from parallel.data.format import FieldSpec, SampleSpec

SPEC = SampleSpec(
    name="unet3d",
    fields=(
        FieldSpec("image", "float32", kind="volume", channels=1, finite=True),
        FieldSpec("label", "uint8", kind="volume", channels=None, valid_range=(0, 2)),
    ),
)
FIELDS = SPEC.names
CLASSES = 3

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
