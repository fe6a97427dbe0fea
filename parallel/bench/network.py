"""The calibration's measurements that need several ranks: point-to-point and all-reduce
latency and bandwidth, the framework's overhead per split layer and per overlapped
exchange and a rank's fixed memory. (Layer times measured while every rank computes at
once are ``parallel.bench.layer_times``'.)"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

import torch
from torch import nn

import parallel
from parallel import comm
from parallel.runtime import memory
from parallel.bench.timing import barrier_trials
from parallel.grid import Grid


def _timed(grid: Grid, fn: Any, trials: int, caller: str) -> float:
    """Median seconds of ``fn`` over ``trials`` barrier-started trials (after one warm-up)."""
    return statistics.median(barrier_trials(fn, trials, grid.device, caller=caller))


def network(grid: Grid, sizes: Sequence[int], trials: int) -> dict[str, Any]:
    """On a world of two: p2p and all-reduce seconds per message size, the overheads, and
    the rank's memory before any model (resident on CPUs; reserved + context on GPUs)."""
    rank = grid.rank
    peer = 1 - rank
    res: dict[str, Any] = {"baseline_memory": memory.in_use_bytes(grid.device)}  # not the peak: inherited across exec
    p2p, ar = [], []
    for n in sizes:
        buf = torch.zeros(n // 4, device=grid.device)

        def ping_pong() -> None:  # 8 one-way messages
            for _ in range(4):
                for sender in (0, 1):
                    if rank == sender:
                        comm.exchange([(peer, buf)], [], caller="calibrate: p2p")
                    else:
                        comm.exchange([], [(peer, buf)], caller="calibrate: p2p")

        def all_reduce() -> None:
            for _ in range(4):
                comm.all_reduce_(buf, None, caller="calibrate: all-reduce")

        p2p.append(_timed(grid, ping_pong, trials, "calibrate: p2p") / 8)
        ar.append(_timed(grid, all_reduce, trials, "calibrate: all-reduce") / 4)
    res["p2p"], res["allreduce"] = p2p, ar

    # The framework's extra cost per split layer (halo messages have their own term): a stack
    # of tiny pointwise convs split 2 ways vs local.
    model = nn.Sequential(*[nn.Conv3d(1, 1, 1) for _ in range(20)])
    pmodel = parallel.parallelize(model, grid)
    if pmodel.sync is not None:  # the gradient all-reduce has its own term in the model
        pmodel.sync.remove()
        pmodel.sync = None
    x = parallel.scatter(torch.randn(1, 1, 4, 2, 2, device=grid.device), grid).requires_grad_(True)
    plain = nn.Sequential(*[nn.Conv3d(1, 1, 1) for _ in range(20)]).to(grid.device)
    split_s = min(_timed(grid, lambda: pmodel(x).sum().backward(), 1, "calibrate: overhead") for _ in range(trials))
    local_s = min(_timed(grid, lambda: plain(x).sum().backward(), 1, "calibrate: overhead") for _ in range(trials))
    res["spatial_layer_overhead"] = max(0.0, (split_s - local_s) / 20)
    res["overlap_overhead"] = overlap_overhead(grid, trials)
    return res


def overlap_overhead(grid: Grid, trials: int) -> float:
    """Seconds an overlapped exchange costs beyond a blocking one: a small halo exchange
    handed to ``parallel.split.halo.in_background`` and waited for, against the same exchange
    made directly (nothing to overlap with, so the difference is the hand-off)."""
    from parallel.split.halo import in_background

    peer = 1 - grid.rank
    out, got = torch.zeros(256, device=grid.device), torch.zeros(256, device=grid.device)

    def swap(a: torch.Tensor) -> torch.Tensor:
        comm.exchange([(peer, a)], [(peer, got)], caller="calibrate: overlap")
        return got

    def blocking() -> None:
        for _ in range(10):
            swap(out)

    def overlapped() -> None:
        for _ in range(10):
            in_background(swap, out).result()

    a = min(_timed(grid, blocking, 1, "calibrate: overlap") for _ in range(trials))
    b = min(_timed(grid, overlapped, 1, "calibrate: overlap") for _ in range(trials))
    return max(0.0, (b - a) / 10)


def fit(sizes: Sequence[int], times: Sequence[float]) -> tuple[float, float]:
    """alpha, beta of ``t = alpha + n / beta``: least squares over the sizes, kept physical
    (a slope no flatter than a 1 TB/s link, a latency of at least 0.1 us)."""
    n = len(sizes)
    mx, mt = sum(sizes) / n, sum(times) / n
    var = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (t - mt) for x, t in zip(sizes, times)) / var if var else 0.0
    slope = max(slope, 1e-12)
    alpha = max(mt - slope * mx, 1e-7)
    return alpha, 1.0 / slope
