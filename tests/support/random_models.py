"""Networks whose own forward draws random numbers (tests/ranks/test_random_draws.py): stochastic
depth, one number per sample, as MONAI's EfficientNet ``drop_connect`` draws it, and noise
shaped like the volume. Importable as ``tests.support.random_models`` from the repository root,
so the training loop can build them by ``model._target_``."""

from __future__ import annotations

import torch
from torch import nn


class DropPath(nn.Module):
    """Stochastic depth: keeps or drops the residual branch per sample (N, 1, 1, 1, 1)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = torch.floor(torch.rand([x.shape[0], 1, 1, 1, 1], dtype=x.dtype, device=x.device) + 1 - self.p)
        return x / (1 - self.p) * keep


class Jitter(nn.Module):
    """Adds Gaussian noise shaped like its input: on a split block, the block's shape."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * torch.randn_like(x) if self.training else x


class Residual(nn.Module):
    def __init__(self, width: int, p: float) -> None:
        super().__init__()
        self.conv = nn.Conv3d(width, width, 3, padding=1)
        self.drop = DropPath(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.conv(x)))


class StochasticDepthNet(nn.Module):
    """A regression network (4 channels in, ``out_channels`` numbers out) with stochastic
    depth in its residual blocks, a global pool and a linear head."""

    def __init__(self, in_channels: int = 4, out_channels: int = 4, width: int = 4, blocks: int = 3,
                 drop: float = 0.5) -> None:
        super().__init__()
        self.stem = nn.Conv3d(in_channels, width, 3, padding=1)
        self.blocks = nn.Sequential(*[Residual(width, drop) for _ in range(blocks)])
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.head = nn.Linear(width, out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.blocks(torch.relu(self.stem(x)))).flatten(1))


class NoisyNet(StochasticDepthNet):
    """The same, with noise shaped like the volume added after the stem (module ``jitter``)."""

    def __init__(self, in_channels: int = 4, out_channels: int = 4, width: int = 4) -> None:
        super().__init__(in_channels, out_channels, width, blocks=1, drop=0.0)
        self.jitter = Jitter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.blocks(self.jitter(torch.relu(self.stem(x))))).flatten(1))
