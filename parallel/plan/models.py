"""Models by family name, for the planner and the benchmarks: the family's network built
from its default model config and ``model.*`` overrides (or, with ``model._target_=...``,
that network from the overrides alone), its input shape and the bytes a sample stores per
voxel."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from parallel.data.format import SampleSpec
from parallel.job.family import get, model_config
from parallel.job.usermodel import input_channels, is_user_model


def stored_bytes_per_voxel(spec: SampleSpec, input_field: str, in_channels: int) -> float:
    """Bytes one voxel of a sample file holds over its volume fields (the input with
    ``in_channels`` channels, the others as the spec says)."""
    total = 0.0
    for f in spec.volume_fields:
        channels = in_channels if f.name == input_field else (f.channels or 1)
        total += torch.empty((), dtype=getattr(torch, f.dtype)).element_size() * channels
    return total


def build_model(name: str, size: Sequence[int], overrides: Sequence[str] = (),
                device: str | torch.device = "meta") -> tuple[nn.Module, tuple[int, ...], float]:
    """(model, per-sample input shape, stored bytes per voxel) of family ``name`` on a volume
    of ``size``; on the meta device unless ``device`` says otherwise."""
    family = get(name)
    cfg = model_config(family, list(overrides))
    spec_channels = family.spec[family.input_field].channels or 1
    in_channels = int(getattr(cfg, "in_channels", spec_channels))
    with torch.device(device):
        model = family.build_model(cfg, tuple(int(s) for s in size))  # type: ignore[arg-type]
    if is_user_model(cfg):  # model._target_=...: its first layer says what it takes
        in_channels = input_channels(model, spec_channels)
    return model, (in_channels, *size), stored_bytes_per_voxel(family.spec, family.input_field, in_channels)
