"""The MLPerf 3D U-Net (KiTS19) as a plain serial module.

Defaults (``UNet3DConfig()``) reproduce the MLPerf Training reference: filters
32, 64, 128, 256, 320, 320 over five stride-2 downsamplings (128^3 -> 4^3); every conv
is Conv3d(k3, bias off) -> InstanceNorm3d(affine) -> ReLU; a down block is a stride-2
conv then a stride-1 conv; an up block is ConvTranspose3d(k2, s2, bias) -> concatenate
the skip -> two convs; the output is Conv3d(k1) logits.

The network knows nothing of the process grid: ``parallel.parallelize(model, grid)``
gives its spatially parallel form, and its input's D, H, W must be multiples of
``2**depth`` (on every rank's block too, for the strides to align).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn


class Norm(str, Enum):
    """Normalisation after each conv (a str Enum: configs validate it, it compares to str)."""

    instance = "instance"
    batch = "batch"
    group = "group"
    none = "none"

    def __str__(self) -> str:
        return str(self.value)


@dataclass
class UNet3DConfig:
    """Shape of the 3D U-Net (section ``model`` of the U-Net job)."""

    in_channels: int = 1
    """Input channels (1 for CT)."""
    n_classes: int = 3
    """Output classes, background included (KiTS19: background, kidney, tumour)."""
    depth: int = 5
    """Stride-2 downsamplings; inputs must be multiples of 2**depth along D, H and W."""
    base_filters: int = 32
    """Filters at full resolution; each level doubles them, up to max_filters."""
    max_filters: int = 320
    """Cap on the filters of any level (MLPerf: 320)."""
    norm: Norm = Norm.instance
    """Normalisation after each conv: instance (MLPerf), batch (LBANN), group, none."""
    norm_groups: int = 8
    """Groups of GroupNorm (capped at the channel count); used when norm is 'group'."""


def level_filters(cfg: UNet3DConfig) -> list[int]:
    """Filters of levels 0 (full resolution) to depth (bottleneck)."""
    return [min(cfg.base_filters * 2**i, cfg.max_filters) for i in range(cfg.depth + 1)]


def _norm(kind: Norm | str, channels: int, groups: int) -> nn.Module:
    if kind == "instance":
        return nn.InstanceNorm3d(channels, affine=True)
    if kind == "batch":
        return nn.BatchNorm3d(channels)
    if kind == "group":
        return nn.GroupNorm(min(groups, channels), channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"model.norm must be instance, batch, group or none, got {kind!r}")


class ConvBlock(nn.Sequential):
    """Conv3d(k3) -> norm -> ReLU; the conv has a bias only when there is no norm."""

    def __init__(self, cin: int, cout: int, stride: int, cfg: UNet3DConfig) -> None:
        super().__init__(
            nn.Conv3d(cin, cout, 3, stride=stride, padding=1, bias=cfg.norm == "none"),
            _norm(cfg.norm, cout, cfg.norm_groups),
            nn.ReLU(inplace=True),
        )


class UpBlock(nn.Module):
    """Transposed conv up, concatenate the skip, two conv blocks."""

    def __init__(self, cin: int, cout: int, cfg: UNet3DConfig) -> None:
        super().__init__()
        self.up = nn.ConvTranspose3d(cin, cout, kernel_size=2, stride=2, bias=True)
        self.conv1 = ConvBlock(2 * cout, cout, 1, cfg)
        self.conv2 = ConvBlock(cout, cout, 1, cfg)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = torch.cat((self.up(x), skip), dim=1)
        return self.conv2(self.conv1(x))


class UNet3D(nn.Module):
    """3D U-Net: (N, in_channels, D, H, W) -> logits (N, n_classes, D, H, W)."""

    def __init__(self, cfg: UNet3DConfig) -> None:
        super().__init__()
        if cfg.depth < 1:
            raise ValueError(f"model.depth must be >= 1, got {cfg.depth}")
        self.cfg = cfg
        f = level_filters(cfg)
        self.input_block = nn.Sequential(ConvBlock(cfg.in_channels, f[0], 1, cfg), ConvBlock(f[0], f[0], 1, cfg))
        self.down = nn.ModuleList(
            nn.Sequential(ConvBlock(f[i], f[i + 1], 2, cfg), ConvBlock(f[i + 1], f[i + 1], 1, cfg))
            for i in range(cfg.depth)
        )
        self.up = nn.ModuleList(UpBlock(f[i + 1], f[i], cfg) for i in reversed(range(cfg.depth)))
        self.output = nn.Conv3d(f[0], cfg.n_classes, kernel_size=1, bias=True)

    @property
    def multiple(self) -> int:
        """Inputs (and each rank's block) must be multiples of this along D, H and W."""
        return 2**self.cfg.depth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = [self.input_block(x)]
        for block in self.down:
            skips.append(block(skips[-1]))
        x = skips.pop()
        for block in self.up:
            x = block(x, skips.pop())
        return self.output(x)
