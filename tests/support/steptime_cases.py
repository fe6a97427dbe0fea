"""Rank functions for tests/unit/test_step_time.py (no tests here): a late rank's neighbour
counts the wait where it happens, in the halo exchange or in the gradient all-reduce."""

from __future__ import annotations

import time

import torch
from torch import nn

import parallel
from parallel.comm import timing
from parallel.grid import Grid

LATE_S = 0.2


def late_rank_waits(grid: Grid, late_before: str, overlap: bool = False) -> dict[str, float]:
    """Rank 1 sleeps ``LATE_S`` before the forward (``forward``) or before the backward
    (``backward``); the seconds each kind took on this rank during that step. ``overlap``:
    the exchange runs on the halo thread (only the wait for its result counts)."""
    torch.manual_seed(0)
    pmodel = parallel.parallelize(nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.LeakyReLU(0.3)), grid,
                                  overlap_halo=overlap)
    x = parallel.scatter(torch.randn(2 if grid.data_size > 1 else 1, 2, 8, 8, 8), grid) \
        if grid.spatial_size > 1 else torch.randn(1, 2, 8, 8, 8)
    pmodel(x).sum().backward()  # a first step: plans and buffers made, not timed
    pmodel.zero_grad(set_to_none=True)
    clock = timing.StepClock(torch.device("cpu"))
    with pmodel.fixed_input((8, 8, 8)):  # as the training loop: no all-gather of the input's block sizes
        clock.start()
        if grid.rank == 1 and late_before == "forward":
            time.sleep(LATE_S)
        out = pmodel(x)
        if grid.rank == 1 and late_before == "backward":
            time.sleep(LATE_S)
        out.sum().backward()
        return clock.stop()
