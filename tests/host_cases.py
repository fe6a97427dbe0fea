"""Rank functions for tests/test_device_paths.py and tests/test_random_draws.py."""

from __future__ import annotations

import copy

import torch

from parallel.grid import Grid


def step_grid_devices(grid: Grid) -> list[str]:
    """The devices of the step benchmark's serial and data grids when the job's grid is on
    ``cuda:0`` (a device object only: nothing is allocated on it)."""
    from parallel.bench.step import step_grids

    on_gpu = copy.copy(grid)
    on_gpu.device = torch.device("cuda", 0)
    return [str(g.device) for g in step_grids(on_gpu)]
