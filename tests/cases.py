"""Functions that run on every rank of a test pool: parallel layers against their serial twins.

Each builds the serial module from a seed, runs it on the global input (per data group
where BatchNorm keeps per-group statistics), runs the parallelised copy on this rank's
part, and compares output, input gradient, parameter gradients and running statistics.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

import parallel
from parallel.grid import Grid

# fp32 sums taken in another order differ by a few ulps of the largest term: 1e-5 of the
# largest reference value bounds that with a wide margin at these sizes.
RTOL = 1e-5


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = RTOL) -> float:
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != serial {tuple(expected.shape)}")
    scale = max(float(expected.abs().max()), 1e-6) if expected.numel() else 1.0
    err = float((actual - expected).abs().max()) if expected.numel() else 0.0
    if not err <= rtol * scale:
        raise AssertionError(f"{what}: max |parallel - serial| = {err:.3e} > {rtol:g} x {scale:.3e}")
    return err / scale


def _local_target(target: torch.Tensor, grid: Grid) -> torch.Tensor:
    if target.dim() == 5:
        return parallel.scatter(target, grid)
    r0, r1 = grid.batch_range(target.shape[0])
    return target[r0:r1]


def check_module(grid: Grid, build: Callable[[], nn.Module], shape: tuple[int, ...], seed: int = 0,
                 sync_batchnorm: bool = False, eval_after: bool = False, steps: int = 1) -> dict[str, Any]:
    """Parallel vs serial: outputs, input gradients, parameter gradients, buffers.

    The serial reference of data group ``d`` is the serial module applied to that group's
    rows (BatchNorm statistics per group), unless ``sync_batchnorm``; the parameter
    gradient is the mean over data groups of their gradients.
    """
    torch.manual_seed(seed)
    serial = build()
    model = copy.deepcopy(serial)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(shape, generator=gen)

    groups = 1 if sync_batchnorm else grid.data_size
    rows = parallel.block_bounds(shape[0], groups)
    replicas = [copy.deepcopy(serial) for _ in rows]
    pmodel = parallel.parallelize(model, grid, sync_batchnorm=sync_batchnorm)
    errors: dict[str, float] = {}
    for step in range(steps):
        xs = x.clone().requires_grad_(True)
        outs = [rep(xs[a:b]) for rep, (a, b) in zip(replicas, rows)]
        ys = torch.cat(outs)
        target = torch.randn(ys.shape, generator=gen)
        (ys * target).sum().backward()
        for rep in replicas:
            for p in rep.parameters():
                if p.grad is not None:
                    p.grad.div_(grid.data_size)

        xl = parallel.scatter(x, grid).requires_grad_(True)
        yl = pmodel(xl)
        (yl * _local_target(target, grid)).sum().backward()

        tag = f"step {step}: "
        errors[tag + "output"] = assert_close(parallel.gather(yl.detach(), grid), ys.detach(), tag + "output")
        errors[tag + "input grad"] = assert_close(parallel.gather(xl.grad, grid), xs.grad, tag + "input grad")
        mine = replicas[0 if sync_batchnorm else grid.data_rank]
        expected_grads = {n: sum(dict(r.named_parameters())[n].grad for r in replicas)
                          for n, p in serial.named_parameters() if p.requires_grad}
        for name, p in pmodel.module.named_parameters():
            errors[tag + name + " grad"] = assert_close(p.grad, expected_grads[name], f"{tag}grad of {name}")
        for name, buf in pmodel.module.named_buffers():
            ref = dict(mine.named_buffers())[name]
            if buf.dtype.is_floating_point:
                errors[tag + name] = assert_close(buf, ref, f"{tag}buffer {name}")
            elif not torch.equal(buf, ref):
                raise AssertionError(f"{tag}buffer {name}: {buf} != serial {ref}")
        for m in (pmodel, *replicas):
            m.zero_grad(set_to_none=True)

    if eval_after:
        pmodel.eval()
        mine.eval()
        with torch.no_grad():
            ref = mine(x[slice(*rows[0 if sync_batchnorm else grid.data_rank])])
            got = parallel.gather(pmodel(parallel.scatter(x, grid)), grid)
            a, b = grid.batch_range(shape[0])
            errors["eval output"] = assert_close(got[a:b], ref, "eval output")
    if set(dict(pmodel.state_dict()).keys()) != set(dict(serial.state_dict()).keys()):
        raise AssertionError("state_dict keys differ from the serial model's")
    return errors


def expect_error(grid: Grid, build: Callable[[], nn.Module], shape: tuple[int, ...]) -> str:
    """Run the parallel module and return the error message it raises (it must raise)."""
    model = build()
    x = torch.randn(shape)
    try:
        pmodel = parallel.parallelize(model, grid)
        pmodel(parallel.scatter(x, grid))
    except (ValueError, NotImplementedError, RuntimeError) as err:
        return str(err)
    raise AssertionError("expected an error, but the parallel forward ran")
