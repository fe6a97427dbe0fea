"""Rank functions for the resampling layers' tests (Upsample, adaptive pooling, padding),
run in float64: the serial twin's numbers to rounding, not to float32's tolerance."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

import cases
import parallel
from parallel.grid import Grid


def check_f64(grid: Grid, build: Callable[[], nn.Module], shape: tuple[int, ...], *args: Any) -> dict[str, Any]:
    """``cases.check_module`` with float64 parameters and input."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return cases.check_module(grid, build, shape, 0, *args)
    finally:
        torch.set_default_dtype(previous)


class Quantize(nn.Module):
    """Rounds to integers with an identity gradient: many equal values (ties for max pooling)
    whose gradients still reach the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (torch.round(2 * x) / 2 - x).detach()


def tied_max(output_size: Any) -> nn.Module:
    return nn.Sequential(Quantize(), nn.AdaptiveMaxPool3d(output_size))


def flattened(build: Callable[[], nn.Module]) -> nn.Module:
    """A global pool's replicated (N, C, 1, 1, 1) output, flattened as a head would (the
    harness gathers 5-D outputs as blocks, replicated 2-D ones as rows)."""
    return nn.Sequential(build(), nn.Flatten())


def classifier_head(channels: int = 3) -> nn.Module:
    """Conv, global pool (replicated output), then Flatten + Linear run as in the serial model."""
    return nn.Sequential(nn.Conv3d(channels, 4, 3, padding=1), nn.ReLU(inplace=True), nn.AdaptiveAvgPool3d(1),
                         nn.Flatten(), nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))


def pool_relu_head() -> nn.Module:
    """An out-of-place ReLU between the global pool and Flatten drops the replicated mark;
    the Linear still sees a whole (N, C, 1, 1, 1) and runs as the serial layer."""
    return nn.Sequential(nn.Conv3d(3, 4, 3, padding=1), nn.AdaptiveMaxPool3d(1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4, 2))


class ViewHead(nn.Module):
    """A global max pool, ``x.view(n, -1)`` and a Linear, as torchvision-style ResNets do."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 3, 3, padding=1)
        self.pool = nn.AdaptiveMaxPool3d((1, 1, 1))
        self.fc = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.conv(x))
        return self.fc(x.view(x.size(0), -1))


class Excite(nn.Module):
    """Squeeze-and-excitation: a replicated global pool, pointwise convs, times the split block."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3, padding=1)
        self.squeeze = nn.Sequential(nn.AdaptiveAvgPool3d(1), nn.Conv3d(4, 2, 1), nn.ReLU(), nn.Conv3d(2, 4, 1),
                                     nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y * self.squeeze(y)


def replicated_volume_output(grid: Grid) -> float:
    """A model whose output is the global pool's (N, C, 1, 1, 1) itself: the same on every
    rank, its gradient counted once (the weight gradients equal the serial ones)."""
    import copy

    import parallel

    torch.manual_seed(0)
    serial = nn.Sequential(nn.Conv3d(2, 3, 3, padding=1), nn.AdaptiveMaxPool3d(1)).double()
    pmodel = parallel.parallelize(copy.deepcopy(serial), grid)
    x = torch.randn(2, 2, 6, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w = torch.randn(2, 3, 1, 1, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ref = serial(x)
    (ref * w).sum().backward()
    out = pmodel(parallel.scatter(x, grid))
    cases.assert_close(out.detach(), ref.detach(), "replicated output")
    (out * w).sum().backward()
    worst = 0.0
    for (name, p), q in zip(pmodel.module.named_parameters(), serial.parameters()):
        worst = max(worst, cases.assert_close(p.grad, q.grad, f"grad of {name}", rtol=1e-12))
    return worst


def global_pool_low_precision(grid: Grid, dtype_name: str) -> float:
    """A global average pool of a bfloat16/float16 volume (as a convolution under autocast
    hands it on), split, against the serial pool under the same autocast: the blocks' sums
    are formed, exchanged and added in float32, so the two differ by float32 summation order
    only. Returns the largest relative difference."""
    dtype = getattr(torch, dtype_name)
    x = torch.randn(2, 3, 8, 6, 4, generator=torch.Generator().manual_seed(0)).add_(4.0).to(dtype)
    serial = nn.AdaptiveAvgPool3d(1)
    pmodel = parallel.parallelize(nn.Sequential(nn.AdaptiveAvgPool3d(1)), grid)
    with torch.autocast("cpu", dtype=dtype):
        ref = serial(x)
        got = pmodel(parallel.scatter(x, grid))
    if got.dtype != torch.float32:
        raise AssertionError(f"the split pool returned {got.dtype}: its block sums were rounded to it")
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max())
