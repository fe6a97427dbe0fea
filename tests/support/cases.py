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
from parallel.layers.linear import shard_of

# fp32 sums taken in another order differ by a few ulps of the largest term: 1e-5 of the
# largest reference value bounds that with a wide margin at these sizes.
RTOL = 1e-5
# float64: the same sums in another order differ by ~1e-16 of the largest term per addition.
RTOL64 = 1e-12


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
                 sync_batchnorm: bool = False, eval_after: bool = False, steps: int = 1,
                 dtype: torch.dtype = torch.float32, overlap: bool | None = None,
                 conv_path: str = "auto") -> dict[str, Any]:
    """Parallel vs serial: outputs, input gradients, parameter gradients, buffers.

    The serial reference of data group ``d`` is the serial module applied to that group's
    rows (BatchNorm statistics per group), unless ``sync_batchnorm``; the parameter
    gradient is the mean over data groups of their gradients. In float64 the tolerance is
    ``RTOL64`` (sums in another order); ``overlap`` and ``conv_path`` are ``parallelize``'s
    ``overlap_halo`` and ``conv_path``.
    """
    torch.manual_seed(seed)
    # the grid's device: the CPU, or a GPU under SPATIALCNN_TEST_DEVICE=cuda
    serial = build().to(grid.device, dtype)
    model = copy.deepcopy(serial)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(shape, generator=gen, dtype=dtype).to(grid.device)
    rtol = RTOL64 if dtype == torch.float64 else RTOL

    groups = 1 if sync_batchnorm else grid.data_size
    rows = parallel.block_bounds(shape[0], groups)
    replicas = [copy.deepcopy(serial) for _ in rows]
    pmodel = parallel.parallelize(model, grid, sync_batchnorm=sync_batchnorm, overlap_halo=overlap,
                                 conv_path=conv_path)
    errors: dict[str, float] = {}
    for step in range(steps):
        xs = x.clone().requires_grad_(True)
        outs = [rep(xs[a:b]) for rep, (a, b) in zip(replicas, rows)]
        ys = torch.cat(outs)
        target = torch.randn(ys.shape, generator=gen, dtype=dtype).to(grid.device)
        (ys * target).sum().backward()
        for rep in replicas:
            for p in rep.parameters():
                if p.grad is not None:
                    p.grad.div_(grid.data_size)

        xl = parallel.scatter(x, grid).requires_grad_(True)
        yl = pmodel(xl)
        (yl * _local_target(target, grid)).sum().backward()

        tag = f"step {step}: "
        errors[tag + "output"] = assert_close(parallel.gather(yl.detach(), grid), ys.detach(), tag + "output", rtol=rtol)
        errors[tag + "input grad"] = assert_close(parallel.gather(xl.grad, grid), xs.grad, tag + "input grad", rtol=rtol)
        mine = replicas[0 if sync_batchnorm else grid.data_rank]
        expected_grads = {n: sum(dict(r.named_parameters())[n].grad for r in replicas)
                          for n, p in serial.named_parameters() if p.requires_grad}
        for name, p in pmodel.module.named_parameters():  # a sharded Linear weight: its columns
            errors[tag + name + " grad"] = assert_close(p.grad, shard_of(p, expected_grads[name]), f"{tag}grad of {name}",
                                                        rtol=rtol)
        for name, buf in pmodel.module.named_buffers():
            ref = dict(mine.named_buffers())[name]
            if buf.dtype.is_floating_point:
                errors[tag + name] = assert_close(buf, ref, f"{tag}buffer {name}", rtol=rtol)
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
            errors["eval output"] = assert_close(got[a:b], ref, "eval output", rtol=rtol)
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
    except (ValueError, NotImplementedError) as err:
        return str(err)
    raise AssertionError("expected an error, but the parallel forward ran")


def check_halo(grid: Grid, n: int, dim: int, windows: list[tuple[int, int]], mode: str) -> float:
    """``fetch`` returns the right window of the global tensor, and ``reduce`` is its
    adjoint: <F x, y> == <x, F^T y> summed over ranks (float64)."""
    from parallel import comm
    from parallel.split.halo import fetch, make_plan, reduce

    shape = [2, 3, 4, 5, 6]
    shape[dim] = n
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(shape, generator=gen, dtype=torch.float64).to(grid.device)
    x = parallel.scatter(full, grid)
    axis = dim - 2
    plan = make_plan(n, grid.line_ranks(dim), grid.coords[axis], windows, mode)  # type: ignore[arg-type]
    fx = fetch(x, dim, plan, fill=-7.0)

    lo, hi = windows[grid.coords[axis]]
    others = [s for a, s in enumerate(grid.block_slices(shape[2:])) if a != axis]
    pieces = []
    for t in range(lo, hi):
        if mode == "circular" or 0 <= t < n:
            pieces.append(full.narrow(dim, t % n, 1))
        else:
            pieces.append(torch.full_like(full.narrow(dim, 0, 1), -7.0))
    expected = torch.cat(pieces, dim=dim)
    index = [slice(None)] * 5
    for a, s in zip([i for i in range(3) if i != axis], others):
        index[a + 2] = s
    assert_close(fx, expected[tuple(index)], "fetched window", rtol=0.0)

    fx0 = fetch(x, dim, plan, fill=0.0)  # adjoint of the linear map (fill 0)
    y = torch.randn(fx0.shape, generator=torch.Generator().manual_seed(100 + grid.rank),
                    dtype=torch.float64).to(grid.device)
    sums = comm.all_reduce_(torch.stack([(fx0 * y).sum(), (x * reduce(y, dim, plan)).sum()]), grid.spatial_group)
    lhs, rhs = float(sums[0]), float(sums[1])
    if abs(lhs - rhs) > 1e-10 * max(abs(lhs), 1.0):
        raise AssertionError(f"<Fx, y> = {lhs!r} but <x, F^T y> = {rhs!r}")
    xg = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(fetch(xg, dim, plan), xg, y)
    assert_close(grad, reduce(y, dim, plan), "autograd backward of fetch", rtol=0.0)
    return abs(lhs - rhs)


def dense_head() -> nn.Module:
    """Conv, Flatten+Linear (partial products + all-reduce), then replicated layers."""
    return nn.Sequential(nn.Conv3d(3, 2, 3, padding=1), nn.LeakyReLU(0.3), nn.Flatten(),
                         nn.Linear(2 * 6 * 5 * 4, 8), nn.ReLU(), nn.Dropout(0.0), nn.Linear(8, 4), nn.Tanh())


def every_layer(grid: Grid, spatial_label: str) -> dict[str, Any]:
    """The selfcheck model (every converted layer type, two heads) against serial."""
    from parallel.verify.selfcheck import run

    report = run(grid, batch=4, size=12)
    if report["max_rel_diff"] > RTOL:
        raise AssertionError(f"{spatial_label}: {report['worst']} differs by {report['max_rel_diff']:.2e}")
    return report


def accumulate_then_sync(grid: Grid) -> float:
    """Two micro-batches under no_sync + one synced step equal one serial step on all three."""
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Conv3d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv3d(3, 1, 3, padding=1))
    pmodel = parallel.parallelize(copy.deepcopy(serial), grid)
    xs = [torch.randn(2, 2, 8, 6, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for x in xs:
        serial(x).sum().backward()
    for i, x in enumerate(xs):
        if i < 2:
            with pmodel.no_sync():
                pmodel(parallel.scatter(x, grid)).sum().backward()
            if grid.spatial_size > 1:  # not yet summed over the spatial group
                mine = next(pmodel.parameters()).grad
                if torch.allclose(mine, next(serial.parameters()).grad * (i + 1) / 3, rtol=1e-3):
                    raise AssertionError("no_sync still synchronised the gradients")
        else:
            pmodel(parallel.scatter(x, grid)).sum().backward()
    worst = 0.0
    for (name, p), q in zip(pmodel.module.named_parameters(), serial.parameters()):
        worst = max(worst, assert_close(p.grad, q.grad / grid.data_size, f"accumulated grad of {name}"))
    return worst


def gradients_in_bucket_views(grid: Grid) -> float:
    """Three SGD steps (zero_grad to None, to zeros, and a gradient replaced by hand) equal
    the serial ones; the gradients are views into the sync's buckets (no packed copy)."""
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Conv3d(2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 8 * 6 * 4, 2))
    pmodel = parallel.parallelize(copy.deepcopy(serial), grid, bucket_mb=0.001)  # several buckets
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    opt_p = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    worst = 0.0
    for step in range(3):
        x = torch.randn(2 * grid.data_size, 2, 8, 6, 4, generator=torch.Generator().manual_seed(step))
        serial(x).square().mean().backward()
        out = pmodel(parallel.scatter(x, grid))  # this data group's rows, this rank's block
        if step == 2:  # a gradient the user set between forward and backward takes the copy path
            first = next(pmodel.parameters())
            first.grad = torch.zeros_like(first)
        # The spatial Linear's output is replicated: the mean over this data group's rows.
        out.square().mean().backward()
        sync = pmodel.sync
        assert sync is not None
        views = [sync._in_place(i) for i in range(len(sync.buckets))]
        if step < 2 and not all(views):
            raise AssertionError(f"step {step}: gradients are not views into their buckets: {views}")
        if step == 2 and all(views):
            raise AssertionError("a gradient replaced by hand was taken for a bucket view")
        for (name, p), q in zip(pmodel.module.named_parameters(), serial.parameters()):
            worst = max(worst, assert_close(p.grad, shard_of(p, q.grad), f"step {step} grad of {name}"))
        opt_s.step()
        opt_p.step()
        opt_s.zero_grad(set_to_none=step != 0)
        opt_p.zero_grad(set_to_none=step != 0)
    for (name, p), q in zip(pmodel.module.named_parameters(), serial.parameters()):
        worst = max(worst, assert_close(p.detach(), shard_of(p, q.detach()), f"weights {name} after 3 steps"))
    return worst


def dropout_masks(grid: Grid) -> list[float]:
    """Dropout after Flatten+Linear drops the same units on every rank of a spatial group."""
    import torch.distributed as dist

    torch.manual_seed(grid.rank)  # different default streams on purpose
    model = nn.Sequential(nn.Conv3d(1, 2, 1), nn.Flatten(), nn.Linear(2 * 4 * 4 * 4, 64), nn.Dropout(0.5))
    pmodel = parallel.parallelize(model, grid)
    out = pmodel(parallel.scatter(torch.ones(2, 1, 4, 4, 4), grid))
    zeros = (out == 0).float()
    if float(zeros.sum()) == 0:
        raise AssertionError("dropout dropped nothing")
    gathered = [torch.empty_like(zeros) for _ in range(grid.spatial_size)]
    dist.all_gather(gathered, zeros, group=grid.spatial_group)
    if not all(torch.equal(g, zeros) for g in gathered):
        raise AssertionError("ranks of one spatial group drew different dropout masks")
    return zeros.flatten().tolist()


def unused_parameter_is_reported(grid: Grid) -> str:
    class TwoBranch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Conv3d(1, 1, 3, padding=1)
            self.unused = nn.Conv3d(1, 1, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    pmodel = parallel.parallelize(TwoBranch(), grid)
    x = parallel.scatter(torch.randn(2, 1, 6, 4, 4), grid)
    pmodel(x).sum().backward()
    try:
        pmodel(x)
    except RuntimeError as err:
        return str(err)
    raise AssertionError("a backward that left parameters without gradients went unnoticed")
