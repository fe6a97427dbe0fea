"""Rank functions for tests/unit/test_comm_layer.py and tests/ranks/test_comm_adjoint.py (no tests here)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from parallel import comm
from parallel.grid import Grid


def refusals(grid: Grid) -> dict[str, str]:
    """What the helpers say about tensors the gloo group cannot take (nothing is sent:
    every rank refuses before the collective, so the pool stays in step)."""
    out = {}
    peer = (grid.rank + 1) % grid.world_size
    cases = {  # partials, so that the frame calling the helper is this function
        "shape": partial(comm.all_reduce_, torch.zeros(3, device="meta"), grid.world_group),
        "dtype": partial(comm.all_gather, torch.zeros(3, dtype=torch.complex64), grid.world_group),
        "layout": partial(comm.broadcast_, torch.zeros(4, 3).t(), 0, grid.world_group),
        "p2p": partial(comm.exchange, [], [(peer, torch.zeros(2, device="meta"))]),
        "explicit": partial(comm.all_reduce_, torch.zeros(2, dtype=torch.int16), grid.world_group, caller="my.caller"),
        "avg_int": partial(comm.all_reduce_, torch.zeros(2, dtype=torch.int64), grid.world_group, "avg"),
    }
    for name, call in cases.items():
        try:
            call()
        except comm.CommError as err:
            out[name] = str(err)
        else:
            raise AssertionError(f"{name}: not refused")
    # The group still works after the refusals, and the helpers do what they say.
    t = comm.all_reduce_(torch.full((2,), float(grid.rank + 1)), grid.world_group, "avg")
    assert t.tolist() == [(grid.world_size + 1) / 2] * 2, t
    parts = comm.all_gather_varlen(torch.arange(grid.rank + 1, dtype=torch.int64), grid.world_group)
    assert [p.tolist() for p in parts] == [list(range(r + 1)) for r in range(grid.world_size)], parts
    got = comm.all_gather_bytes(f"rank{grid.rank}".encode() * grid.rank, grid.world_group)
    assert got == [f"rank{r}".encode() * r for r in range(grid.world_size)], got
    b = comm.broadcast_(torch.tensor([grid.rank], dtype=torch.int64), grid.world_size - 1, grid.world_group)
    assert int(b) == grid.world_size - 1
    assert comm.all_reduce_(torch.tensor([grid.rank]), grid.world_group, "max").item() == grid.world_size - 1
    assert comm.all_reduce_(torch.tensor([grid.rank]), grid.world_group, "min").item() == 0
    comm.barrier(grid.world_group, timeout_s=30)
    return out


def _dot_over(group, *pairs: tuple[torch.Tensor, torch.Tensor]) -> list[float]:
    """Each ``<a, b>`` summed over the ranks of ``group`` (float64)."""
    sums = torch.stack([(a.double() * b.double()).sum() for a, b in pairs])
    return comm.all_reduce_(sums, group).tolist()


def _check(what: str, lhs: float, rhs: float, tol: float = 1e-12) -> float:
    if abs(lhs - rhs) > tol * max(abs(lhs), abs(rhs), 1.0):
        raise AssertionError(f"{what}: <F x, y> = {lhs!r} but <x, F^T y> = {rhs!r}")
    return abs(lhs - rhs)


def _random(shape, seed: int, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(device)


def adjoints(grid: Grid) -> dict[str, float]:
    """<F x, y> == <x, F^T y> for every communication primitive with an adjoint, where F^T
    is what autograd runs in the backward (inner products summed over the ranks that hold
    the values; replicated values counted once where the convention says so)."""
    import parallel
    from parallel.split.halo import fetch_all, make_plan, reduce_all
    from parallel.partition import block_bounds

    out: dict[str, float] = {}
    world, spatial = grid.world_group, grid.spatial_group

    # all_reduce_sum over the spatial group: y_r = sum_s x_s; the adjoint sums the same way.
    x = _random((3, 4), 10 + grid.rank, grid.device).requires_grad_(True)
    y = _random((3, 4), 50 + grid.rank, grid.device)
    fx = parallel.all_reduce_sum(x, spatial)
    (g,) = torch.autograd.grad(fx, x, y)
    out["all_reduce_sum"] = _check("all_reduce_sum", *_dot_over(world, (fx, y), (x, g)))

    # gather: blocks -> the whole tensor on every rank; the adjoint sums every rank's
    # cotangent over the block's region.
    full_shape = (2 * grid.data_size, 2, 7, 5, 6)
    x = parallel.scatter(_random(full_shape, 7, grid.device), grid).clone().requires_grad_(True)
    y = _random(full_shape, 90 + grid.rank, grid.device)
    fx = parallel.gather(x, grid)
    (g,) = torch.autograd.grad(fx, x, y)
    out["gather"] = _check("gather", *_dot_over(world, (fx, y), (x, g)))

    # scatter: a copy of the global tensor on each rank -> this rank's part; the adjoint
    # puts the cotangent back in place, zeros elsewhere (no communication).
    x = _random(full_shape, 3 + grid.rank, grid.device).requires_grad_(True)
    fx = parallel.scatter(x, grid)
    y = _random(fx.shape, 30 + grid.rank, grid.device)
    (g,) = torch.autograd.grad(fx, x, y)
    out["scatter"] = _check("scatter", *_dot_over(world, (fx, y), (x, g)))

    # spatial_sum: partial sums -> one replicated value, counted once; its backward hands
    # every rank the same cotangent (the identity).
    x = _random((2, 3), 60 + grid.rank, grid.device).requires_grad_(True)
    y = _random((2, 3), 5 + grid.data_rank, grid.device)  # replicated over the spatial group
    fx = parallel.spatial_sum(x, grid)
    (g,) = torch.autograd.grad(fx, x, y)
    lhs = _dot_over(grid.data_group, (fx, y))[0] if grid.data_size > 1 else float((fx * y).sum())
    rhs = _dot_over(world, (x, g))[0]
    out["spatial_sum"] = _check("spatial_sum", lhs, rhs)

    # replicated_grad: a value computed identically on every spatial rank; the gradients
    # of its S copies, summed by the gradient sync, count it once: sum_r g_r == y.
    x = _random((4,), 8 + grid.data_rank, grid.device).requires_grad_(True)
    y = _random((4,), 9 + grid.data_rank, grid.device)
    (g,) = torch.autograd.grad(parallel.replicated_grad(x, grid), x, y)
    summed = comm.all_reduce_(g.detach().clone(), spatial) if grid.spatial_size > 1 else g
    out["replicated_grad"] = _check("replicated_grad", float((x * y).sum()), float((x.detach() * summed).sum()))

    # the halo chain (fetch_all / reduce_all, as the overlapped convolution uses them) along
    # every split dim at once, corners included: reduce_all is fetch_all's adjoint.
    volume = (7, 6, 5)
    steps = []
    for axis, parts in enumerate(grid.spatial):
        if parts > 1:
            n = volume[axis]
            windows = [(a - 2, b + 1) for a, b in block_bounds(n, parts)]
            steps.append((axis + 2, make_plan(n, grid.line_ranks(axis + 2), grid.coords[axis], windows)))
    x = parallel.scatter(_random((grid.data_size, 2, *volume), 1, grid.device), grid)
    fx = fetch_all(x, steps)
    y = _random(fx.shape, 70 + grid.rank, grid.device)
    out["halo chain"] = _check("fetch_all/reduce_all", *_dot_over(world, (fx, y), (x, reduce_all(y, steps))))
    return out


def late_barrier(rank: int, world: int, port: int, results: Any) -> None:
    """A world of its own (not the shared pool: a barrier left waiting would put the pool
    out of step): rank 0 waits at a barrier with a short timeout while rank 1 comes late."""
    import os
    import time
    from datetime import timedelta

    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    try:
        if rank == 0:
            try:
                comm.barrier(None, timeout_s=0.5)
                results.put((rank, "no timeout"))
            except TimeoutError as err:
                results.put((rank, str(err)))
        else:
            time.sleep(2.0)
            comm.barrier(None, timeout_s=20)  # completes rank 0's timed-out barrier, still posted
            results.put((rank, "late"))
        comm.barrier(None, timeout_s=20)  # everyone meets here: then the group goes down cleanly
    finally:
        dist.destroy_process_group()
