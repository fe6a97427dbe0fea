"""CosmoFlow's sample fields and the transform the reader applies to each block.

``volume``: (4, D, H, W) int16 particle counts (4 redshifts); ``target``: 4 float32
cosmological parameters normalised to [-1, 1].
"""

from __future__ import annotations

import torch

from parallel.data.format import FieldSpec, SampleSpec

SPEC = SampleSpec(
    name="cosmoflow",
    fields=(
        FieldSpec("volume", "int16", kind="volume", channels=4, valid_range=(0, 32767)),
        FieldSpec("target", "float32", kind="scalar", shape=(4,), finite=True),
    ),
)
FIELDS = SPEC.names


def transform(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``log(x + 1)`` of the counts ("apply_log" in the reference), on the block."""
    out = dict(sample)
    out["volume"] = torch.log1p(sample["volume"].float())
    return out
