"""Rank functions for tests/ranks/test_monai.py: MONAI 1.6 networks, split, against their serial
selves in float64 (every output, the input gradient and every parameter gradient)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import parallel
from parallel.grid import Grid

# float64 sums in another order differ by ~1e-16 per term; 1e-9 of the largest value is a
# wide margin through ~100 layers, and a split error is O(1).
RTOL = 1e-9
GROUPS = ("group", {"num_groups": 2})
TINY_HIGHRES = (
    {"name": "conv_0", "n_features": 4, "kernel_size": 3},
    {"name": "res_1", "n_features": 4, "kernels": (3, 3), "repeat": 1},
    {"name": "res_2", "n_features": 8, "kernels": (3, 3), "repeat": 1},
    {"name": "res_3", "n_features": 8, "kernels": (3, 3), "repeat": 1},
    {"name": "conv_1", "n_features": 8, "kernel_size": 1},
    {"name": "conv_2", "kernel_size": 1},
)


def build(name: str) -> nn.Module:
    """A MONAI network for 3-D inputs at tiny width, dropout off."""
    from monai.networks import nets

    specs: dict[str, Any] = {
        "UNet": lambda: nets.UNet(3, 1, 2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1),
        "BasicUNet": lambda: nets.BasicUNet(3, 1, 2, features=(4, 4, 8, 8, 8, 4), upsample="nontrainable"),
        "DynUNet": lambda: nets.DynUNet(3, 1, 2, kernel_size=[3, 3, 3], strides=[1, 2, 2], upsample_kernel_size=[2, 2],
                                        filters=[4, 8, 8], deep_supervision=True, deep_supr_num=1, res_block=True),
        "SegResNet": lambda: nets.SegResNet(3, init_filters=4, in_channels=1, out_channels=2, norm=GROUPS),
        "SegResNetDS": lambda: nets.SegResNetDS(3, init_filters=4, in_channels=1, out_channels=2, norm=GROUPS,
                                                blocks_down=(1, 2, 2), dsdepth=2),
        "VNet": lambda: nets.VNet(3, 1, 2, dropout_prob_down=0.0, dropout_prob_up=(0.0, 0.0)),
        "AttentionUnet": lambda: nets.AttentionUnet(3, 1, 2, channels=(4, 8, 16), strides=(2, 2)),
        "DenseNet121": lambda: nets.DenseNet121(spatial_dims=3, in_channels=1, out_channels=2, init_features=4,
                                                growth_rate=2, bn_size=2),
        "resnet10": lambda: nets.resnet10(spatial_dims=3, n_input_channels=1, num_classes=2, widen_factor=0.125),
        "resnet18": lambda: nets.resnet18(spatial_dims=3, n_input_channels=1, num_classes=2, widen_factor=0.0625),
        "HighResNet": lambda: nets.HighResNet(3, 1, 2, layer_params=TINY_HIGHRES),
        "EfficientNet": lambda: nets.EfficientNet(["r1_k3_s11_e1_i8_o8_se0.25", "r1_k3_s22_e2_i8_o8_se0.25"],
                                                  spatial_dims=3, in_channels=1, num_classes=2, width_coefficient=0.25,
                                                  dropout_rate=0.0, image_size=32, drop_connect_rate=0.0),
        "SegResNetVAE": lambda: nets.SegResNetVAE((16, 16, 16), spatial_dims=3, init_filters=4, in_channels=1,
                                                  out_channels=2, norm=GROUPS),
    }
    net = specs[name]()
    for m in net.modules():  # dropout off (VNet keeps p=0.5 in two up blocks whatever it is told)
        if isinstance(m, (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)):
            m.p = 0.0
    return net


def _leaves(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _leaves(o)]


def _part(full: torch.Tensor, grid: Grid) -> torch.Tensor:
    """This rank's part of a serial output of this data group: a block of the last three
    dims for volumes (5-D and up), the whole tensor otherwise (replicated)."""
    if full.dim() < 5:
        return full
    return full[(...,) + grid.block_slices(full.shape[-3:])]


def _rel(got: torch.Tensor, ref: torch.Tensor, scale: float, what: str) -> float:
    if got.shape != ref.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)} != serial {tuple(ref.shape)}")
    err = float((got - ref).abs().max()) / scale
    if not err <= RTOL:
        raise AssertionError(f"{what}: max |split - serial| is {err:.2e} of the largest value")
    return err


def serial_reference(name: str, shape: tuple[int, ...], data_size: int) -> dict[str, Any]:
    """The serial network's numbers, computed once in the test process (not on every rank):
    the input, each data group's outputs and output weights, the input gradient and every
    parameter gradient of the summed loss (each data group's loss over the data size)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        serial = build(name).train()
        state = copy.deepcopy(serial.state_dict())
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        rows = parallel.block_bounds(shape[0], data_size)
        outs_by_group, weights_by_group = [], []
        xs = x.clone().requires_grad_(True)
        for d, (r0, r1) in enumerate(rows):
            outs = _leaves(serial(xs[r0:r1]))
            gen = torch.Generator().manual_seed(100 + d)
            ws = [torch.randn(o.shape, generator=gen) for o in outs]
            (sum((o * w).sum() for o, w in zip(outs, ws)) / data_size).backward()
            outs_by_group.append([o.detach() for o in outs])
            weights_by_group.append(ws)
        grads = {n: p.grad for n, p in serial.named_parameters()}
        return {"state": state, "x": x, "outs": outs_by_group, "weights": weights_by_group, "input_grad": xs.grad,
                "grads": grads, "rows": rows}
    finally:
        torch.set_default_dtype(previous)


def check_net(grid: Grid, name: str, ref: dict[str, Any]) -> dict[str, float]:
    """The split network equals the serial one (``serial_reference``): outputs, input
    gradient, every parameter gradient (mean over data groups, each with its own BatchNorm
    statistics)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        net = build(name).train()
        net.load_state_dict(ref["state"])  # the serial network's weights, before its step
        pmodel = parallel.parallelize(net, grid)
        x, rows = ref["x"], ref["rows"]
        if len(rows) != grid.data_size:
            raise AssertionError(f"reference for {len(rows)} data groups, grid has {grid.data_size}")
        a, b = rows[grid.data_rank]
        mine, weights = ref["outs"][grid.data_rank], ref["weights"][grid.data_rank]
        errors: dict[str, float] = {}
        xl = parallel.scatter(x, grid).requires_grad_(True)
        outs = _leaves(pmodel(xl))
        if len(outs) != len(mine):
            raise AssertionError(f"{len(outs)} outputs, serial {len(mine)}")
        for i, (o, r) in enumerate(zip(outs, mine)):
            errors[f"output {i}"] = _rel(o.detach(), _part(r, grid), float(r.abs().max()), f"{name} output {i}")
        sum((o * _part(w, grid)).sum() for o, w in zip(outs, weights)).backward()
        ref_in = ref["input_grad"][a:b] * grid.data_size  # the serial loss was this group's loss over the data size
        errors["input grad"] = _rel(xl.grad, _part(ref_in, grid), float(ref_in.abs().max()), f"{name} input grad")
        grads = ref["grads"]
        present = [g for g in grads.values() if g is not None]
        scale = max(float(g.abs().max()) for g in present)
        checked = 0
        for pname, p in pmodel.module.named_parameters():
            r = grads[pname]
            if r is None and p.grad is None:
                continue
            if r is None or p.grad is None:
                raise AssertionError(f"{name}: gradient of {pname} exists in only one of the models")
            # Relative to the largest gradient: a conv bias before a norm has a zero gradient in exact maths.
            errors[pname] = _rel(p.grad, r, max(float(r.abs().max()), 1e-3 * scale), f"{name} grad of {pname}")
            checked += 1
        if checked != len(present):
            raise AssertionError(f"{name}: compared {checked} parameter gradients")
        return errors
    finally:
        torch.set_default_dtype(previous)


def refused(grid: Grid, name: str) -> str:
    """``parallelize`` refuses the network by name; returns the message."""
    try:
        parallel.parallelize(build(name), grid)
    except NotImplementedError as err:
        return str(err)
    raise AssertionError(f"{name} was parallelised")


def verify_stops(grid: Grid, name: str, shape: tuple[int, ...]) -> str:
    """``parallelize(..., verify=probe)`` raises for this network at this probe; the message."""
    from parallel.verify import VerificationError

    torch.manual_seed(0)
    try:
        parallel.parallelize(build(name), grid, verify=shape)
    except VerificationError as err:
        return str(err)
    raise AssertionError(f"{name} passed verification")


def verify_passes(grid: Grid, name: str) -> dict[str, float]:
    """``parallelize(..., verify=True)``: the probe sized from the network passes."""
    from parallel.verify import verify

    torch.manual_seed(0)
    serial = build(name)
    pmodel = parallel.parallelize(copy.deepcopy(serial), grid)
    return verify(serial, pmodel)
