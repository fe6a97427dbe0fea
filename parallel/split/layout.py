"""Memory layouts of activation tensors: NCDHW (torch's default) or channels-last (NDHWC,
``torch.channels_last_3d``), which oneDNN's CPU kernels and cuDNN's bf16 path prefer.

A split layer allocates its windows and gradients in the layout of the tensor it got, so
that a channels-last model (``parallelize(..., channels_last=True)``) stays channels-last
from layer to layer. Messages between ranks are always NCDHW-contiguous (the halo
exchange's send and receive buffers): two ranks never have to agree on a layout, and the
copy that packs or unpacks a halo converts it at no extra pass. Parameters keep torch's
default layout, so checkpoints are the same bytes either way.
"""

from __future__ import annotations

from typing import Sequence

import torch

CHANNELS_LAST = torch.channels_last_3d


def preferred(device: torch.device, precision: str) -> bool:
    """Whether channels-last is the faster layout for training on ``device`` at
    ``precision`` (``fp32``, ``bf16``, ``fp16``, ``fp64``), as measured so far: on CPUs at
    float32 (NDHWC step time 0.65-0.89 of NCDHW for CosmoFlow and the U-Net, serial and
    split, on 6 December 2026: docs/benchmarks/channels_last_cpu-2core_2026-12-06.md). Not
    yet measured, so False: other CPU precisions and GPUs (``scripts/gpu_check.sh`` times
    a run with and without it)."""
    return device.type == "cpu" and precision == "fp32"


def memory_format(x: torch.Tensor) -> torch.memory_format:
    """``channels_last_3d`` for a 5-D tensor laid out channels-last (dense or a view of
    one), else ``contiguous_format``. Where both describe the memory (one channel), NCDHW."""
    if x.dim() != 5 or x.is_contiguous():
        return torch.contiguous_format
    if x.is_contiguous(memory_format=CHANNELS_LAST):
        return CHANNELS_LAST
    spatial = [x.stride(d) for d in (2, 3, 4) if x.shape[d] > 1]
    return CHANNELS_LAST if x.shape[1] > 1 and spatial and x.stride(1) < min(spatial) else torch.contiguous_format


def empty(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` with ``like``'s dtype, device and layout."""
    return torch.empty(list(shape), dtype=like.dtype, device=like.device, memory_format=memory_format(like))


def zeros(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """Zeros of ``shape`` with ``like``'s dtype, device and layout."""
    return empty(shape, like).zero_()


def dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous in its own layout (no copy when it already is)."""
    return x.contiguous(memory_format=memory_format(x))


def channels_last(x: torch.Tensor) -> torch.Tensor:
    """A 5-D tensor laid out NDHWC (no copy when it already is); others unchanged."""
    if x.dim() != 5 or x.is_contiguous(memory_format=CHANNELS_LAST):
        return x
    return x.contiguous(memory_format=CHANNELS_LAST)
