"""Networks a user brings to the training loop by ``model._target_=user_models.<Name>``
(tests/launch/test_user_models.py puts this folder on PYTHONPATH)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Resize(nn.Module):
    """Doubles D, H and W with ``F.interpolate``: on a split tensor it resizes the block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=2, mode="trilinear")


class InterpolatingSegNet(nn.Module):
    """Segmentation logits at the input's size, through a functional resize and back."""

    def __init__(self, in_channels: int = 1, out_channels: int = 3, width: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv3d(in_channels, width, 3, padding=1)
        self.up = Resize()
        self.down = nn.AvgPool3d(2)
        self.head = nn.Conv3d(width, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(self.up(torch.relu(self.stem(x)))))
