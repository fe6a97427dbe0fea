"""Which 5-D tensors are the same on every rank of a spatial group.

A global pool (``AdaptiveAvgPool3d(1)``) ends the split: its output, (N, C, 1, 1, 1), is
replicated over the spatial group. Its shape alone cannot say so (a volume of 2 voxels
split 2 ways also gives blocks of one voxel), so the layer that makes it marks it, and
the layers that must treat it differently (``Flatten`` + ``Linear``: no partial product)
and the model's output (gradient counted once, ``parallel.comm.replicated_grad``) read
the mark. The mark is an attribute of the tensor object: it survives in-place layers
(``ReLU(inplace=True)``) but not new tensors made from it.
"""

from __future__ import annotations

import torch

_MARK = "_parallel_replicated"


def mark_replicated(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as replicated over the spatial group; returns ``t``."""
    setattr(t, _MARK, True)
    return t


def is_replicated(t: object) -> bool:
    """Whether ``t`` was marked replicated by a spatial layer."""
    return isinstance(t, torch.Tensor) and bool(getattr(t, _MARK, False))
