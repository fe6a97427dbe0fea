"""Rank functions for tests/ranks/test_channels_last.py (no tests here): the channels-last
(NDHWC) path against the default (NCDHW) one, layer by layer, in float64."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

import cases
import parallel
from parallel.grid import Grid

CL = torch.channels_last_3d

NETS: dict[str, Callable[[], nn.Module]] = {
    # CosmoFlow-shaped: 3 input channels (oneDNN answers NCDHW: the hook lays it out NDHWC),
    # the shell path (3^3, padding 1), a window path (stride 2), pooling, Flatten+Linear.
    "conv_pool_linear": lambda: nn.Sequential(
        nn.Conv3d(3, 4, 3, padding=1), nn.LeakyReLU(0.3), nn.MaxPool3d(2),
        nn.Conv3d(4, 4, 3, stride=2, padding=1), nn.AvgPool3d(1), nn.Flatten(), nn.Linear(4 * 2 * 2 * 2, 5)),
    # U-Net-shaped: norms, a transposed conv (overlaps summed back), upsampling, padding, a 5-D output.
    "norms_transposed": lambda: nn.Sequential(
        nn.Conv3d(3, 4, 3, padding=1), nn.InstanceNorm3d(4, affine=True), nn.ReLU(),
        nn.Conv3d(4, 4, 2, stride=2), nn.BatchNorm3d(4), nn.GroupNorm(2, 4),
        nn.ConvTranspose3d(4, 4, 3, stride=2, padding=1, output_padding=1), nn.ConstantPad3d(1, 0.5),
        nn.Conv3d(4, 2, 3, dilation=2, padding=1), nn.Upsample(scale_factor=2, mode="trilinear")),
    "global_pool": lambda: nn.Sequential(
        nn.Conv3d(3, 4, 5, padding=2, padding_mode="circular"), nn.AdaptiveAvgPool3d(1), nn.Flatten(),
        nn.Linear(4, 2)),
}


def equals_default(grid: Grid, name: str, shape: tuple[int, ...] = (2, 3, 8, 8, 8)) -> dict[str, Any]:
    """Two SGD steps of net ``name`` parallelised with and without ``channels_last``: the same
    outputs, input and parameter gradients, weights and state_dict (float64); every layer's
    5-D output was NDHWC on the channels-last path; the parameters kept torch's default layout."""
    torch.manual_seed(0)
    base = NETS[name]().double()
    runs = {}
    formats: list[tuple[str, bool]] = []

    def record(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if output.dim() == 5:
            formats.append((type(module).__name__, output.is_contiguous(memory_format=CL)))

    for cl in (False, True):
        pmodel = parallel.parallelize(copy.deepcopy(base), grid, channels_last=cl, seed=1)
        if cl:
            for m in pmodel.module.modules():  # every layer but the containers and the Linear
                if not isinstance(m, (nn.Sequential, nn.Linear, nn.Flatten)):
                    m.register_forward_hook(record)
        opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
        got = []
        for step in range(2):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
            xl = parallel.scatter(x, grid).requires_grad_(True)
            y = pmodel(xl)
            y.square().mean().backward()
            full = parallel.gather(y.detach(), grid)
            got.append({"output": full, "input grad": parallel.gather(xl.grad, grid),
                        **{f"grad {n}": p.grad.clone() for n, p in pmodel.module.named_parameters()}})
            if cl and y.dim() == 5 and not (y.is_contiguous(memory_format=CL) and full.is_contiguous(memory_format=CL)):
                raise AssertionError(f"{name}: the 5-D output or its gather is not NDHWC: strides {y.stride()}")
            opt.step()
            opt.zero_grad(set_to_none=True)
        state = pmodel.state_dict()
        got.append({f"state {k}": v for k, v in state.items()})
        if cl and not all(v.is_contiguous() for v in state.values()):
            raise AssertionError(f"{name}: a channels-last model's state_dict holds non-default layouts")
        runs[cl] = got
    worst = 0.0
    for a, b in zip(runs[False], runs[True]):
        for key in a:
            # A conv bias before InstanceNorm has a zero gradient in exact arithmetic: its value is
            # the roundoff of the step's gradients, so it is measured against 1e-4 of the largest.
            floor = 1e-4 * max(float(v.abs().max()) for k, v in a.items() if k.startswith("grad")) if key.startswith(
                "grad") else 0.0
            scale = max(float(a[key].abs().max()), floor, 1e-6)
            err = float((b[key] - a[key]).abs().max())
            if not err <= cases.RTOL64 * scale:
                raise AssertionError(f"{name}: channels-last {key}: max |cl - default| = {err:.3e} > "
                                     f"{cases.RTOL64:g} x {scale:.3e}")
            worst = max(worst, err / scale)
    if not formats or not all(ok for _, ok in formats):
        raise AssertionError(f"{name}: layer outputs on the channels-last path not NDHWC: {formats}")
    return {"worst": worst, "convs": sum(kind.endswith(("Conv3d", "ConvTranspose3d")) for kind, _ in formats)}


def scatter_keeps_layout(grid: Grid) -> list[bool]:
    """scatter cuts a copy in the global batch's layout (no view keeping the batch alive),
    and gather of NDHWC blocks is the NDHWC global tensor, with the right values."""
    x = torch.randn(2, 3, 6, 4, 5, generator=torch.Generator().manual_seed(0))
    out = []
    for fmt in (torch.contiguous_format, CL):
        g = x.contiguous(memory_format=fmt)
        part = parallel.scatter(g, grid)
        out.append(part.is_contiguous(memory_format=fmt))
        out.append(part.untyped_storage().data_ptr() != g.untyped_storage().data_ptr())
        whole = parallel.gather(part, grid)
        out.append(whole.is_contiguous(memory_format=fmt))
        out.append(torch.equal(whole, x))
    return out
