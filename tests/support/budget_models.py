"""A network for the memory-budget tests (``model._target_=budget_models.LeakyRegressor``;
tests/launch/test_memory_budget.py puts this folder on PYTHONPATH)."""

from __future__ import annotations

import time

import torch
from torch import nn


class LeakyRegressor(nn.Module):
    """CosmoFlow's four outputs from one conv and a global pool, keeping ``leak_mb`` MiB of
    filled memory per training forward: a leak no planner can see (a user's model that
    keeps every batch it saw), which only the running budget catches. ``delay_s``: each
    training forward also waits this long, as a real network's step would take, so the
    leak grows at the pace of steps rather than all at once."""

    def __init__(self, in_channels: int = 4, out_features: int = 4, leak_mb: int = 64, delay_s: float = 0.0) -> None:
        super().__init__()
        self.conv = nn.Conv3d(in_channels, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.head = nn.Linear(4, out_features)
        self.leak_mb = leak_mb
        self.delay_s = delay_s
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and x.device.type == "cpu":
            self.kept.append(torch.ones(self.leak_mb * 2**18))  # touched: resident, not only reserved
            time.sleep(self.delay_s)
        return self.head(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))
