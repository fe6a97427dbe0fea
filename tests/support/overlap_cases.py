"""Rank functions for tests/ranks/test_conv_paths.py (no tests here): the overlapped conv, recompute."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

import cases
import parallel
from parallel.grid import Grid
from parallel.layers.conv.layer import SpatialConv3d


def conv_shell(grid: Grid, build: Callable[[], nn.Module], shape: tuple[int, ...], overlap: bool) -> dict[str, Any]:
    """check_module in float64 (blocking or overlapped exchange); and whether every split
    conv took the shell path (no window) and, overlapped, overlapped its exchange."""
    errors: dict[str, Any] = {"check": cases.check_module(grid, build, shape, dtype=torch.float64, overlap=overlap,
                                                          conv_path="shell")}
    model = build().double()
    pmodel = parallel.parallelize(model, grid, overlap_halo=overlap, conv_path="shell")
    pmodel(parallel.scatter(torch.randn(shape, dtype=torch.float64), grid))
    layers = [m for m in pmodel.modules() if isinstance(m, SpatialConv3d)]
    geometries = [g for m in layers for g in m._plan_cache.values()]
    errors["shell_taken"] = bool(geometries) and all(g[2] is not None for g in geometries)
    errors["overlapped"] = [bool(g[3]) for g in geometries]
    errors["talks"] = [any(p is not None and not p.is_local for p in g[1]) for g in geometries]
    errors["corrections"] = [len(g[2].corrections) for g in geometries if g[2] is not None]
    return errors


def conv_path(grid: Grid, build: Callable[[], nn.Module], shape: tuple[int, ...], path: str,
              window_bytes: int | None = None) -> list[str | None]:
    """check_module in float64 with ``parallelize(conv_path=path, conv_window_bytes=...)``;
    the path each split conv then took (``SpatialConv3d.path_chosen``)."""
    cases.check_module(grid, build, shape, dtype=torch.float64, conv_path=path)
    model = build().double()
    pmodel = parallel.parallelize(model, grid, conv_path=path, conv_window_bytes=window_bytes)
    pmodel(parallel.scatter(torch.randn(shape, dtype=torch.float64), grid))
    return [m.path_chosen for m in pmodel.modules() if isinstance(m, SpatialConv3d)]


def _net(dropout: float, norm: bool) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv3d(2, 4, 3, padding=1)]
    if norm:
        layers.append(nn.BatchNorm3d(4))
    layers += [nn.Dropout(dropout), nn.LeakyReLU(0.3), nn.MaxPool3d(2),
               nn.Conv3d(4, 4, 3, padding=1), nn.Dropout3d(dropout), nn.MaxPool3d(2),
               nn.Flatten(), nn.Linear(4 * 2 * 2 * 2, 8), nn.Dropout(dropout), nn.Linear(8, 2)]
    return nn.Sequential(*layers)


def recompute_equals_plain(grid: Grid, dropout: float, norm: bool, steps: int = 2) -> dict[str, float]:
    """Two training steps with and without per-block recomputation: identical numbers."""
    from parallel.model.recompute import checkpoint_blocks

    results = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = _net(dropout, norm)
        # one conv path for both runs: "auto" may time its way to the other path, whose sums round differently
        pmodel = parallel.parallelize(model, grid, seed=1, conv_path="shell")
        if recompute:
            assert checkpoint_blocks(pmodel.module) == 3, "expected 3 blocks (2 pools + head)"
        torch.manual_seed(5 + grid.rank)
        opt = torch.optim.SGD(pmodel.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(3)
        outs, grads = [], []
        for _ in range(steps):
            x = torch.randn(2, 2, 8, 8, 8, generator=gen)
            xl = parallel.scatter(x, grid).requires_grad_(True)
            out = pmodel(xl)
            out.square().sum().backward()
            outs.append(out.detach().clone())
            grads.append([p.grad.clone() for p in pmodel.parameters()] + [xl.grad.clone()])
            opt.step()
            opt.zero_grad(set_to_none=True)
        state = {k: v.clone() for k, v in pmodel.state_dict().items()}
        results.append((outs, grads, state))
    (o0, g0, s0), (o1, g1, s1) = results
    worst = 0.0
    for a, b in zip(o0, o1):
        worst = max(worst, cases.assert_close(b, a, "output with recompute"))
    for ga, gb in zip(g0, g1):
        for a, b in zip(ga, gb):
            worst = max(worst, cases.assert_close(b, a, "gradient with recompute"))
    for k in s0:
        if s0[k].dtype.is_floating_point:
            worst = max(worst, cases.assert_close(s1[k], s0[k], f"state {k} with recompute"))
        elif not torch.equal(s0[k], s1[k]):
            raise AssertionError(f"state {k} differs with recompute")
    return {"worst": worst}


def unet_recompute_blocks(grid: Grid) -> int:
    from parallel.model.recompute import checkpoint_blocks
    from unet3d.model import UNet3D, UNet3DConfig

    torch.manual_seed(0)
    cfg = UNet3DConfig(depth=2, base_filters=4, max_filters=8)
    serial = UNet3D(cfg)
    ref = copy.deepcopy(serial)
    pmodel = parallel.parallelize(serial, grid)
    n = checkpoint_blocks(pmodel.module)
    x = torch.randn(1, 1, 8, 8, 8)
    xl = parallel.scatter(x, grid).requires_grad_(True)
    pmodel(xl).square().sum().backward()
    xs = x.clone().requires_grad_(True)
    ref(xs).square().sum().backward()
    cases.assert_close(parallel.gather(xl.grad, grid), xs.grad, "U-Net input grad with recompute")
    for (name, p), q in zip(pmodel.module.named_parameters(), ref.parameters()):
        cases.assert_close(p.grad, q.grad, f"U-Net grad of {name} with recompute")
    return n


def shell_adjoint(grid: Grid, shape: tuple[int, ...], windows: dict[int, list[tuple[int, int]]],
                  mode: str) -> float:
    """The onion of ``fetch_shell`` assembles exactly ``halo.fetch_all``'s window, and
    ``reduce_shell`` (with ``scatter_grad``) is its adjoint: <F x, y> == <x, F^T y> summed
    over ranks, in float64."""
    from parallel import comm
    from parallel.split.halo import fetch_all, make_plan
    from parallel.partition import block_bounds
    from parallel.split.shell import assemble, fetch_shell, reduce_shell, scatter_grad, shell_step

    gen = torch.Generator().manual_seed(0)
    full = torch.randn(shape, generator=gen, dtype=torch.float64)
    x = parallel.scatter(full, grid)
    steps, chain = [], []
    for dim, wins in sorted(windows.items()):
        axis = dim - 2
        plan = make_plan(shape[dim], grid.line_ranks(dim), grid.coords[axis], wins, mode)  # type: ignore[arg-type]
        block = block_bounds(shape[dim], grid.spatial[axis])[grid.coords[axis]]
        st = shell_step(dim, plan, wins[grid.coords[axis]], block)
        assert st is not None, f"dim {dim}: no shell step for window {wins[grid.coords[axis]]}"
        steps.append(st)
        chain.append((dim, plan))
    window = fetch_all(x, chain)
    shell = fetch_shell(x, steps)
    built = assemble(x, shell, steps, len(steps), {}, False)
    cases.assert_close(built, window, "window assembled from the shell", rtol=0.0)
    y = torch.randn(window.shape, generator=torch.Generator().manual_seed(100 + grid.rank), dtype=torch.float64)
    gshell = [(torch.zeros_like(a), torch.zeros_like(b)) for a, b in shell]
    adds: list = []
    scatter_grad(y, gshell, steps, len(steps), {}, adds)
    adds += reduce_shell(gshell, steps, tuple(x.shape))
    gx = torch.zeros_like(x)
    for idx, t in adds:
        gx[idx] += t
    sums = comm.all_reduce_(torch.stack([(window * y).sum(), (x * gx).sum()]), grid.spatial_group)
    lhs, rhs = float(sums[0]), float(sums[1])
    if abs(lhs - rhs) > 1e-10 * max(abs(lhs), 1.0):
        raise AssertionError(f"<Fx, y> = {lhs!r} but <x, F^T y> = {rhs!r}")
    return abs(lhs - rhs)
