"""Which way a split convolution runs: the shell or the window.

Both compute the same convolution of the rank's window (its block plus the halos):

- shell (``parallel.layers.conv.shell``): the block is convolved in place and the halos'
  contributions added by thin correction convolutions; no copy of the block, and the
  halo exchange can overlap the block's convolution. Forward and backward each pay one
  call per correction besides the block's.
- window (``parallel.split.halo.fetch`` then one convolution, as LBANN DistConv and PhysicsNeMo
  ShardTensor do): the block and halos are copied into one tensor, convolved in one call
  and differentiated in one call; the window (the block's size plus the halos) is kept for
  the backward.

On CPUs the window's one large call is often faster than the shell's thin ones (oneDNN
runs thin convolutions at a fraction of its speed), but not always, and the window costs a
block-sized copy of memory per layer. So ``path="auto"`` (opt-in: the shell, which
keeps no copy, is the default that memory budgets are predicted for) times both, forward
and backward, on the layer's own input at its first forward per geometry, the slowest rank
of the spatial group deciding (one all-reduce, so all ranks take the same path), and takes
the faster; a window larger than ``window_limit_bytes`` (a memory budget) is never chosen.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

import torch

from parallel import comm

log = logging.getLogger(__name__)

PATHS = ("auto", "shell", "window")


def check_path(path: str, where: str) -> str:
    if path not in PATHS:
        raise ValueError(f"{where}: conv_path must be one of {', '.join(PATHS)}, got {path!r}")
    return path


def window_bytes(x: torch.Tensor, window_shape: tuple[int, ...]) -> int:
    return math.prod(window_shape) * x.element_size()


def _seconds(run: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def faster_path(shell: Callable[[], None], window: Callable[[], None], group: object, device: torch.device,
                rounds: int = 3) -> tuple[str, list[float]]:
    """``"shell"`` or ``"window"``: the one whose forward and backward (``shell()``,
    ``window()``) took less, best of ``rounds`` alternated runs, slowest rank counting.
    Every rank of ``group`` must call this together (both paths exchange halos)."""
    best = [math.inf, math.inf]
    for i in range(rounds):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for j in order:
            best[j] = min(best[j], _seconds(shell if j == 0 else window, device))
    t = torch.tensor(best, dtype=torch.float64, device=comm.group_device(group))
    comm.all_reduce_(t, group, "max", caller="parallel.layers.conv.paths")
    secs = t.tolist()
    return ("window" if secs[1] < secs[0] else "shell"), secs
