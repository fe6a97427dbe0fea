"""Rank functions for tests/ranks/test_flatshard.py (no tests here): Flatten+Linear weights sharded by block."""

from __future__ import annotations

import copy
import logging
import math
import threading
from typing import Any

import torch
from torch import nn

import cases
import parallel
from parallel.grid import Grid
from parallel.layers.linear import SpatialLinear

SHAPE = (2, 8, 6, 4)   # one sample: C, D, H, W


def net(shape: tuple[int, ...] = SHAPE, pool: bool = True) -> nn.Module:
    """CosmoFlow-shaped: conv, pool, Flatten + Linear (sharded), a replicated head."""
    features = 3 * math.prod(n // 2 if pool else n for n in shape[1:])
    return nn.Sequential(nn.Conv3d(shape[0], 3, 3, padding=1), nn.LeakyReLU(0.3),
                         nn.MaxPool3d(2) if pool else nn.Identity(), nn.Flatten(),
                         nn.Linear(features, 5), nn.ReLU(), nn.Linear(5, 2))


def _sharded(pmodel: parallel.ParallelModule) -> SpatialLinear:
    layers = [m for m in pmodel.module.modules() if isinstance(m, SpatialLinear) and m.shard is not None]
    if len(layers) != 1:
        raise AssertionError(f"expected one sharded Linear, found {len(layers)}")
    return layers[0]


def training_equals_serial(grid: Grid, optim: str, shape: tuple[int, ...] = SHAPE, pool: bool = True,
                           steps: int = 3, lazy: bool = False, meta: bool = True) -> dict[str, Any]:
    """``steps`` training steps (float64) with the Linear's weight sharded equal the serial
    model's: outputs, gradients (this rank's columns), weights and the optimiser's state, and
    ``state_dict`` gathers the serial tensors. Returns the shard's shapes. ``lazy``: no
    ``input_shape``, so the weight is sharded at the first forward, after the optimiser
    was built on the whole parameter: cut before the model's first layer runs (from a trace
    of the serial structure on the meta device), or, ``meta=False`` (a model that cannot be
    copied there), when the forward reaches the Linear."""
    torch.manual_seed(0)
    serial = net(shape, pool).double()
    model = copy.deepcopy(serial)
    if not meta:
        model.lock = threading.Lock()  # type: ignore[assignment]  # a model deepcopy cannot copy
    pmodel = parallel.parallelize(model, grid, input_shape=None if lazy else shape)
    if lazy:
        whole = [m for m in pmodel.module.modules() if isinstance(m, SpatialLinear) and m.shard_pending]
        if len(whole) != 1 or whole[0].weight.shape[1] != whole[0].in_features:
            raise AssertionError(f"before the first forward: expected one whole weight waiting, got {whole}")
        param = whole[0].weight
        cut_before_first_layer: list[bool] = []
        pmodel.module[0].register_forward_pre_hook(
            lambda module, inputs: cut_before_first_layer.append(whole[0].shard is not None))

    def make(params: Any) -> torch.optim.Optimizer:
        if optim == "adamw":
            return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    opt_s, opt_p = make(serial.parameters()), make(pmodel.parameters())
    for step in range(steps):
        x = torch.randn(2 * grid.data_size, *shape, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
        serial(x).square().mean().backward()
        out = pmodel(parallel.scatter(x, grid))
        if step == 0:
            layer = _sharded(pmodel)
            if lazy and layer.weight is not param:
                raise AssertionError("sharding at the first forward replaced the parameter the optimiser holds")
            if lazy and cut_before_first_layer != [meta]:
                raise AssertionError(f"weight cut before the first layer ran: {cut_before_first_layer}, expected {meta}")
        out.square().mean().backward()
        r0, r1 = grid.batch_range(x.shape[0])
        cases.assert_close(out.detach(), serial(x[r0:r1]).detach(), f"step {step} output", rtol=cases.RTOL64)
        cases.assert_close(layer.weight.grad, layer.cut(serial[4].weight.grad), f"step {step} shard's gradient",
                           rtol=cases.RTOL64)
        opt_s.step()
        opt_p.step()
        opt_s.zero_grad(set_to_none=True)
        opt_p.zero_grad(set_to_none=True)
    state = pmodel.state_dict()  # collective: the sharded weight gathered whole
    for key, value in serial.state_dict().items():
        cases.assert_close(state[key], value, f"state_dict {key} after {steps} steps", rtol=cases.RTOL64)
    from parallel.layers.linear import gather_optimizer_state

    whole = gather_optimizer_state(opt_p, pmodel.module)["state"]
    for pid, ref in opt_s.state_dict()["state"].items():
        for key, value in ref.items():
            if isinstance(value, torch.Tensor) and value.dim():
                cases.assert_close(whole[pid][key], value, f"optimizer {key} of parameter {pid}", rtol=cases.RTOL64)
    state_keys = [k for k, v in opt_p.state[layer.weight].items() if isinstance(v, torch.Tensor) and v.dim()]
    return {"weight": list(layer.weight.shape), "grad_or_state": [list(opt_p.state[layer.weight][k].shape)
                                                                  for k in state_keys],
            "in_features": layer.in_features, "columns": layer.shard.columns if layer.shard else 0}


def load_any_grid_state(grid: Grid, lazy: bool = False) -> float:
    """A whole (serial) model and optimiser state loads as this rank's columns, and training
    on from it equals the serial model trained on from the same state. ``lazy``: no
    ``input_shape``; the whole state is loaded as it is before the first forward shards
    the weight (the optimiser's next step cuts its state)."""
    torch.manual_seed(0)
    serial = net().double()
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(2 * grid.data_size, *SHAPE, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    serial(x).square().mean().backward()
    opt_s.step()   # momentum exists now
    opt_s.zero_grad(set_to_none=True)
    saved_model, saved_opt = copy.deepcopy(serial.state_dict()), copy.deepcopy(opt_s.state_dict())

    torch.manual_seed(1)   # other initial weights: everything must come from the state
    pmodel = parallel.parallelize(net().double(), grid, input_shape=None if lazy else SHAPE)
    opt_p = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    pmodel.load_state_dict(saved_model)
    from parallel.layers.linear import cut_optimizer_state

    if lazy:
        opt_p.load_state_dict(saved_opt)  # whole: nothing is sharded yet
    else:
        layer = _sharded(pmodel)
        opt_p.load_state_dict(cut_optimizer_state(saved_opt, opt_p, pmodel.module))
        if tuple(opt_p.state[layer.weight]["momentum_buffer"].shape) != tuple(layer.weight.shape):
            raise AssertionError("the loaded momentum of the sharded weight was not cut to its columns")
    worst = 0.0
    for step in range(2):
        xs = torch.randn(2 * grid.data_size, *SHAPE, generator=torch.Generator().manual_seed(step),
                         dtype=torch.float64)
        serial(xs).square().mean().backward()
        pmodel(parallel.scatter(xs, grid)).square().mean().backward()
        opt_s.step()
        opt_p.step()
        if lazy and step == 0:
            layer = _sharded(pmodel)
            if tuple(opt_p.state[layer.weight]["momentum_buffer"].shape) != tuple(layer.weight.shape):
                raise AssertionError("the whole momentum loaded before the first forward was not cut")
        opt_s.zero_grad(set_to_none=True)
        opt_p.zero_grad(set_to_none=True)
    for key, value in serial.state_dict().items():
        worst = max(worst, cases.assert_close(pmodel.state_dict()[key], value, f"{key} after resuming",
                                              rtol=cases.RTOL64))
    return worst


def kfac_leaves_the_shard(grid: Grid) -> list[str]:
    """K-FAC leaves a sharded Linear to the plain update and says why (logged)."""
    from parallel.kfac import KFAC

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep()
    logging.getLogger("parallel").addHandler(handler)
    logging.getLogger("parallel").setLevel(logging.INFO)
    try:
        pmodel = parallel.parallelize(net(), grid, input_shape=SHAPE)
        opt = KFAC(pmodel, grid, lr=0.1)
    finally:
        logging.getLogger("parallel").removeHandler(handler)
    names = [layer.name for layer in opt.layers]
    if "4" in names:
        raise AssertionError(f"K-FAC preconditions the sharded Linear: {names}")
    return [r for r in records if "sharded" in r]


def low_precision_like_serial(grid: Grid, dtype_name: str) -> dict[str, Any]:
    """A Flatten+Linear of 2,048 features under autocast (``dtype_name``: bfloat16 or
    float16), sharded, against the serial layer under the same autocast: each one's error
    from the exact result of the rounded inputs (float64 products and sums of the values
    autocast rounds to), for the output, the input gradient and the weight gradient (this
    rank's columns), relative to the largest exact value. Returns {"serial": ..., "split": ...,
    "dtypes": [the serial output's dtype, the split's]}."""
    dtype = getattr(torch, dtype_name)
    shape = (4, 8, 8, 8)
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), 8))
    pmodel = parallel.parallelize(copy.deepcopy(serial), grid, input_shape=shape)
    layer = _sharded(pmodel)
    gen = torch.Generator().manual_seed(1)
    if grid.data_size != 1:
        raise AssertionError("a spatial grid only: the weight gradient is compared before any data-group average")
    x = torch.randn(2, *shape, generator=gen)
    g = torch.randn(x.shape[0], 8, generator=gen)
    lin = serial[1]

    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(dtype).double()

    # exact maths on the rounded values (the output gradient reaches the layer rounded, as y is)
    xr, wr, br, gr = rounded(x.flatten(1)), rounded(lin.weight), rounded(lin.bias), rounded(g)
    exact = {"output": xr @ wr.T + br, "input grad": (gr @ wr).reshape(x.shape), "weight grad": gr.T @ xr}

    def errors(model: nn.Module, xin: torch.Tensor, cut: Any) -> dict[str, float]:
        xin = xin.detach().requires_grad_(True)
        with torch.autocast("cpu", dtype=dtype):
            y = model(xin)
        dtypes.append(str(y.dtype))
        (y.float() * g).sum().backward()
        weight = layer.weight if model is pmodel else lin.weight
        got = {"output": y.double(), "input grad": xin.grad.double(), "weight grad": weight.grad.double()}
        ref = {"output": exact["output"], "input grad": cut(exact["input grad"]),
               "weight grad": exact["weight grad"] if model is serial else layer.cut(exact["weight grad"])}
        return {k: float((got[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in got}

    dtypes: list[str] = []
    return {"serial": errors(serial, x, lambda t: t),
            "split": errors(pmodel, parallel.scatter(x, grid), lambda t: t[(...,) + grid.block_slices(t.shape[-3:])]),
            "dtypes": dtypes}
