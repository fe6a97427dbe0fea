"""Rank functions for tests/ranks/test_verify.py: models whose own forward splits wrongly, and
models that verify cleanly."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import parallel
from parallel.grid import Grid
from parallel.verify import VerificationError, verify


class Up(nn.Module):
    """A decoder step that resizes functionally: on a split tensor it resizes the block."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(self.conv(x), scale_factor=2, mode="trilinear")


class Widen(nn.Module):
    """Joins two tensors along W: on split tensors it joins blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.conv(x), x], dim=4)


class Net(nn.Module):
    def __init__(self, middle: nn.Module) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.BatchNorm3d(2), nn.ReLU())
        self.middle = middle
        self.head = nn.Conv3d(2, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.middle(self.stem(x)))


class Good(nn.Module):
    """Module forms only, plus channel concatenation and a replicated squeeze: verifies."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="trilinear")
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.mix = nn.Conv3d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([self.conv(x), x], dim=1)
        return self.mix(self.up(y * self.pool(y).sigmoid()))


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return Net({"interpolate": Up, "cat-w": Widen, "good": Good}[kind]())


def stopped(grid: Grid, kind: str) -> str:
    """``parallelize(..., verify=True)`` must raise; returns the message."""
    try:
        parallel.parallelize(_model(kind), grid, verify=True)
    except VerificationError as err:
        return str(err)
    raise AssertionError("the split model passed verification")


def passes(grid: Grid, kind: str, probe: tuple[int, ...] | None) -> dict:
    """A correct model verifies, standalone and through parallelize, and verification
    leaves the model's buffers, gradients and modes as they were."""
    model = _model(kind)
    serial = copy.deepcopy(model)
    pmodel = parallel.parallelize(model, grid)
    pmodel.module.middle.train()
    before = {k: v.clone() for k, v in pmodel.state_dict().items()}
    report = verify(serial, pmodel, probe)
    after = pmodel.state_dict()
    changed = [k for k, v in before.items() if not torch.equal(v, after[k])]
    if changed:
        raise AssertionError(f"verification changed {changed}")
    if any(p.grad is not None for p in pmodel.parameters()):
        raise AssertionError("verification left gradients behind")
    parallel.parallelize(_model(kind), grid, verify=probe or True)
    # The model still trains after verification: a step's gradients equal the serial ones.
    x = torch.randn(grid.data_size * 2, 1, 8, 8, 8, generator=torch.Generator().manual_seed(1))
    serial.load_state_dict(pmodel.state_dict())
    if any(p.grad is not None for p in serial.parameters()):
        raise AssertionError("verification left gradients in the serial copy")
    pmodel(parallel.scatter(x, grid)).square().sum().backward()
    r0, r1 = grid.batch_range(x.shape[0])
    for d in range(grid.data_size):
        a, b = parallel.block_bounds(x.shape[0], grid.data_size)[d]
        serial(x[a:b]).square().sum().backward()
    # Relative to the largest gradient: the conv bias before BatchNorm has a zero gradient in exact maths.
    scale = max(float(q.grad.abs().max()) for q in serial.parameters()) / grid.data_size
    for (name, p), q in zip(pmodel.module.named_parameters(), serial.parameters()):
        err = float((p.grad - q.grad / grid.data_size).abs().max()) / scale
        if err > 1e-4:
            raise AssertionError(f"gradient of {name} after verification differs by {err:.2e}")
    return report


def cosmoflow_verifies(grid: Grid) -> dict:
    """CosmoFlow's Flatten + Linear head (partial products over the split volume) verifies:
    the split Flatten's 5-D block is compared with the block of the volume it flattens."""
    from cosmoflow.model import CosmoFlow, CosmoFlowConfig

    torch.manual_seed(0)
    model = CosmoFlow(CosmoFlowConfig(n_conv_blocks=2, conv_filters=2, dense_sizes=[4], dropout=0.0), (8, 8, 8))
    serial = copy.deepcopy(model)
    pmodel = parallel.parallelize(model, grid)
    return verify(serial, pmodel, (grid.data_size, 4, 8, 8, 8))
