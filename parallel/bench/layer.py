"""Halo overhead: a spatial conv (forward and backward apart) against the best plain conv
on the same local block without communication, and against the conv of a window cut
beforehand (the split layer's arithmetic without the exchange)."""

from __future__ import annotations

import copy
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import parallel
from parallel.bench.timing import interleaved, median, ratio, spread
from parallel.grid import Grid
from parallel.layers.conv.kernels import conv3d, thin_order

SPLIT_VARIANTS = ("blocking", "overlap", "window_exchange")
"""The spatial conv's halo paths: the shell blocking and overlapped (the framework's), and
the whole window fetched and copied before the convolution (the path K-FAC's hooks take)."""


def _best(times: dict[str, list[float]], key: str) -> list[float]:
    """Per trial, the faster plain conv (torch's own kernel choice or the split layer's)."""
    return [min(a, b) for a, b in zip(times[f"plain_torch{key}"], times[f"plain{key}"])]


def conv_overhead(grid: Grid, size: int, channels: int, kernel: int, batch: int, trials: int,
                  variants: tuple[str, ...] = SPLIT_VARIANTS) -> dict[str, Any]:
    """Per-trial seconds (forward and backward apart) of the plain convs on this rank's block
    and of the spatial conv's variants, and their ratios (medians of per-trial ratios)."""
    torch.manual_seed(0)
    conv = nn.Conv3d(channels, channels, kernel, padding=kernel // 2)
    shape = (batch, channels, size, size, size)
    local = tuple(b - a for a, b in grid.block_range(shape[2:]))
    x = torch.randn(batch, channels, *local, requires_grad=True)
    plain = copy.deepcopy(conv)
    pmodel = parallel.parallelize(copy.deepcopy(conv), grid)
    if pmodel.sync is not None:
        pmodel.sync.remove()  # time the halo, not the weight-gradient all-reduce
    spatial = pmodel.module
    with torch.no_grad():
        g = torch.randn_like(plain(x))
    pads = [kernel // 2] * 3
    halo = [kernel // 2 if p > 1 else 0 for p in grid.spatial]
    window = F.pad(x.detach(), [h for h in reversed(halo) for _ in (0, 1)]).requires_grad_(True)
    wpads = [0 if h else p for p, h in zip(pads, halo)]

    def timed(inp: torch.Tensor, layer: nn.Module, forward: Callable[[], torch.Tensor]) -> dict[str, float]:
        inp.grad = None
        layer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        y = forward()
        t1 = time.perf_counter()
        y.backward(g)
        return {"forward": t1 - t0, "backward": time.perf_counter() - t1}

    def split(mode: str) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            spatial.overlap = mode == "overlap"
            spatial.window_hook = (lambda *a: None) if mode == "window_exchange" else None
            with pmodel.shapes.forward(shape):
                return timed(x, spatial, lambda: spatial(x))
        return run

    w, b = plain.weight, plain.bias
    runs: dict[str, Callable[[], dict[str, float]]] = {
        "plain_torch": lambda: timed(x, plain, lambda: F.conv3d(x, w, b, 1, pads)),   # torch's kernel choice
        "plain": lambda: timed(x, plain, lambda: conv3d(x, w, b, [1] * 3, pads, [1] * 3, 1)),  # the split layer's
        "window": lambda: timed(window, plain, lambda: conv3d(window, w, b, [1] * 3, wpads, [1] * 3, 1)),
    }
    for v in variants:
        runs[v] = split(v)
    times = interleaved(runs, trials, warmup=2, group=grid.spatial_group, cpu=True)
    for key in ("", ".forward", ".backward"):
        times[f"best_plain{key}"] = _best(times, key)
    times["best_plain.cpu"] = [min(a, b) for a, b in zip(times["plain_torch.cpu"], times["plain.cpu"])]
    out: dict[str, Any] = {"local_block": list(local), "thin_reordered": thin_order(x, w, 1) is not None,
                           "overlap_chosen": spatial.overlap_chosen,
                           "seconds": {k: median(v) for k, v in times.items()},
                           "spread": {k: spread(v) for k, v in times.items() if "." not in k}}
    phases = {"total": "", "forward": ".forward", "backward": ".backward", "cpu": ".cpu"}
    out["fair"] = {v: {p: ratio(times[v + k], times["best_plain" + k]) for p, k in phases.items()} for v in variants}
    out["vs_window"] = {v: {p: ratio(times[v + k], times["window" + k]) for p, k in phases.items()}
                        for v in variants}
    out["plain_torch_over_plain"] = ratio(times["plain_torch"], times["plain"])
    return out
