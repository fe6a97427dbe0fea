"""Halo overhead: a spatial conv (forward + backward) against the plain conv on the same
local block without communication."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import parallel
from parallel.bench.timing import interleaved, median, ratio
from parallel.grid import Grid


def conv_overhead(grid: Grid, size: int, channels: int, kernel: int, batch: int, trials: int,
                  variants: tuple[str, ...] = ("overlap", "blocking")) -> dict[str, Any]:
    """Per-trial seconds of the plain local conv and of the spatial conv (each variant)."""
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

    def step(layer: nn.Module, overlap: bool | None = None) -> None:
        if overlap is not None:
            layer.overlap = overlap
        x.grad = None
        layer.zero_grad(set_to_none=True)
        with pmodel.shapes.forward(shape):
            y = layer(x)
        y.backward(g)

    # The spatial path's own compute with no exchange: the conv on a window cut beforehand.
    pads = [kernel // 2] * 3
    halo = [kernel // 2 if p > 1 else 0 for p in grid.spatial]
    window = torch.nn.functional.pad(x.detach(), [h for h in reversed(halo) for _ in (0, 1)]).requires_grad_(True)
    for a, h in enumerate(halo):
        if h:
            pads[a] = 0

    def windowed() -> None:
        window.grad = None
        plain.zero_grad(set_to_none=True)
        torch.nn.functional.conv3d(window, plain.weight, plain.bias, 1, pads).backward(g)

    runs = {"plain": lambda: step(plain), "window": windowed}
    for v in variants:
        runs[v] = (lambda ov: (lambda: step(spatial, ov)))(v == "overlap")
    times = interleaved(runs, trials, warmup=2, group=grid.spatial_group)
    out: dict[str, Any] = {"local_block": list(local), "seconds": {k: median(v) for k, v in times.items()}}
    out["overhead"] = {v: ratio(times[v], times["plain"]) for v in variants}
    out["overhead_vs_window"] = {v: ratio(times[v], times["window"]) for v in variants}
    return out
