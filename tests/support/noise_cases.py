"""Rank functions of tests/ranks/test_noise_scale.py: the data groups' gradients that the
hierarchical sync forms, against each group's gradient computed by the serial model."""

from __future__ import annotations

import copy

import torch
from torch import nn

import parallel
from parallel.grid import Grid
from parallel.train.gradnorm import global_grad_norm
from parallel.train.observe.noisescale import NoiseScale

SHAPE = (2, 8, 6, 4)  # one sample's (C, D, H, W)


def _serial() -> nn.Module:
    """A conv, a Flatten+Linear (its weight sharded by block at a spatial split) and a
    replicated Linear: every kind of gradient the sync handles."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(2, 3, 3, padding=1), nn.LeakyReLU(0.3), nn.Flatten(),
                         nn.Linear(3 * 8 * 6 * 4, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def _batch(grid: Grid, step: int, per_group: int) -> torch.Tensor:
    return torch.randn(per_group * grid.data_size, *SHAPE, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(100 + step))


def _backward(pmodel: nn.Module, x: torch.Tensor, grid: Grid, accum: int) -> None:
    """This data group's rows, this rank's block; the loss is the mean over the group's rows,
    summed over ``accum`` micro-batches as the training step does."""
    start, stop = grid.batch_range(len(x))
    mine = parallel.scatter(x, grid)
    assert len(mine) == stop - start
    for i, xm in enumerate(torch.tensor_split(mine, accum)):
        if i < accum - 1:
            with pmodel.no_sync():
                (pmodel(xm).square().mean() / accum).backward()
        else:
            (pmodel(xm).square().mean() / accum).backward()


def _group_gradients(serial: nn.Module, x: torch.Tensor, data_size: int) -> list[torch.Tensor]:
    """Each data group's gradient of the mean loss over its rows, by the serial model."""
    out = []
    for rows in torch.tensor_split(x, data_size):
        serial.zero_grad(set_to_none=True)
        serial(rows).square().mean().backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in serial.parameters()]))
    serial.zero_grad(set_to_none=True)
    return out


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


def logged_norms_against_groups(grid: Grid, accum: int, steps: int = 2, collectives: bool = False) -> dict[str, float]:
    """``steps`` SGD steps with the hierarchical sync measuring (fp64): at each, the logged
    |G_small|^2 and |G_big|^2 (``NoiseScale.log_values``, what metrics.jsonl gets) equal
    the mean of the data groups' squared norms and the squared norm of their mean, computed
    by the serial model from each group's rows, to 1e-9; the unbiased estimates follow the
    formulas. The weights end where the plain sync's (one all-reduce) end, and where serial's do.
    ``collectives``: the sync's reduce-scatter and all-gather through the backend's own
    collectives, the path NCCL takes, instead of gloo's point-to-point messages."""
    from parallel.comm import ops

    saved = ops.MESSAGES_ON
    ops.MESSAGES_ON = () if collectives else saved
    try:
        return _logged_norms(grid, accum, steps)
    finally:
        ops.MESSAGES_ON = saved


def _logged_norms(grid: Grid, accum: int, steps: int) -> dict[str, float]:
    per_group = 2 * accum
    serial = _serial()
    runs = {}
    worst = {"small": 0.0, "big": 0.0, "estimates": 0.0, "weights_vs_flat": 0.0, "weights_vs_serial": 0.0}
    for measure in (True, False):
        pmodel = parallel.parallelize(copy.deepcopy(serial), grid, bucket_mb=0.0005, input_shape=SHAPE)
        on = pmodel.measure_noise_scale(measure)
        assert on == measure, (on, measure)
        if measure and grid.spatial_size > 1:
            assert pmodel.sync.hierarchical and any(getattr(p, "spatial_shard", False) for p in pmodel.parameters())
        opt = torch.optim.SGD(pmodel.parameters(), lr=0.1)
        noise = NoiseScale(per_group * grid.data_size, grid.data_size, decay=0.5)
        for step in range(steps):
            x = _batch(grid, step, per_group)
            _backward(pmodel, x, grid, accum)
            if measure:
                small = float(pmodel.sync.small_norm_sq())
                big = float(global_grad_norm(list(pmodel.parameters()), grid)) ** 2
                noise.update(small, big)
                logged = noise.log_values()
                # independently: the serial model on each group's rows, at the same weights
                ref = copy.deepcopy(serial)
                ref.load_state_dict(pmodel.state_dict())
                groups = _group_gradients(ref, x, grid.data_size)
                small_ref = sum(float(g.square().sum()) for g in groups) / len(groups)
                big_ref = float(torch.stack(groups).mean(0).square().sum())
                worst["small"] = max(worst["small"], _rel(logged["noise_grad_sq_small"], small_ref))
                worst["big"] = max(worst["big"], _rel(logged["noise_grad_sq_big"], big_ref))
                b, B = per_group, per_group * grid.data_size
                g2 = (B * big_ref - b * small_ref) / (B - b)
                trace = (small_ref - big_ref) / (1 / b - 1 / B)
                worst["estimates"] = max(worst["estimates"], _rel(logged["noise_grad_sq_est"], g2),
                                         _rel(logged["noise_grad_var_est"], trace))
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs[measure] = pmodel.state_dict()
    # serial: the same steps on the whole batch (the mean of the groups' means)
    opt = torch.optim.SGD(serial.parameters(), lr=0.1)
    for step in range(steps):
        x = _batch(grid, step, per_group)
        sum(serial(rows).square().mean() for rows in torch.tensor_split(x, grid.data_size)).div(
            grid.data_size).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for key, ref in serial.state_dict().items():
        scale = float(ref.abs().max())
        flat = float((runs[True][key] - runs[False][key]).abs().max()) / scale
        worst["weights_vs_flat"] = max(worst["weights_vs_flat"], flat)
        worst["weights_vs_serial"] = max(worst["weights_vs_serial"], float((runs[True][key] - ref).abs().max()) / scale)
    for key, limit in (("small", 1e-9), ("big", 1e-9), ("estimates", 1e-9), ("weights_vs_flat", 1e-12),
                       ("weights_vs_serial", 1e-12)):
        if not worst[key] < limit:
            raise AssertionError(f"{key}: {worst[key]:.3e} relative (limit {limit:g}) at data {grid.data_size} x "
                                 f"spatial {grid.spatial}, accumulation {accum}")
    return worst


def scatter_and_gather(grid: Grid) -> float:
    """``comm.reduce_scatter_async`` and ``all_gather_async`` over the spatial group (four
    ranks, an odd part length) against the sum and the concatenation of every rank's tensor:
    as gloo runs them (point-to-point messages) and through the backend's own collectives, the
    path NCCL takes (``comm.ops.MESSAGES_ON`` emptied; gloo has both collectives)."""
    from parallel import comm
    from parallel.comm import ops

    size, n = grid.spatial_size, 5
    every = [torch.arange(size * n, dtype=torch.float64) * (r + 1) + r for r in range(grid.world_size)]
    mine, me = every[grid.rank], grid.spatial_rank
    expected = sum(every[grid.rank - me + r] for r in range(size))[me * n:(me + 1) * n]
    gathered = torch.cat([every[grid.rank - me + r][:n] + r for r in range(size)])
    saved = ops.MESSAGES_ON
    try:
        for path, backends in (("messages", saved), ("collectives", ())):
            ops.MESSAGES_ON = backends
            shard = torch.empty(n, dtype=torch.float64)
            comm.reduce_scatter_async(shard, mine.clone(), grid.spatial_group).wait()
            if not torch.equal(shard, expected):
                raise AssertionError(f"rank {grid.rank} ({path}): reduce-scatter {shard.tolist()} != {expected.tolist()}")
            out = torch.full((size * n,), -1.0, dtype=torch.float64)
            comm.all_gather_async(out, mine[:n] + me, grid.spatial_group).wait()
            if not torch.equal(out, gathered):
                raise AssertionError(f"rank {grid.rank} ({path}): all-gather {out.tolist()} != {gathered.tolist()}")
    finally:
        ops.MESSAGES_ON = saved
    return float(shard.sum())
