"""Functions that run on every rank of a test pool: K-FAC steps at a grid against the plain
serial K-FAC of ``kfac_reference`` (float64)."""

from __future__ import annotations

import copy
import io
from typing import Any

import torch
from torch import nn

import parallel
from kfac_reference import ReferenceKFAC
from parallel.kfac import KFAC, KFACConfig
from parallel.layers.linear import gather_optimizer_state, whole

SHAPE = (4, 2, 8, 8, 8)
LR, MOMENTUM = 0.1, 0.9
# float64 sums taken in another order (per block, then all-reduced) differ by a few ulps;
# the damped solves amplify that by at most ~1e3 here: 1e-10 of the largest value bounds it.
RTOL = 1e-10


def build() -> nn.Module:
    """Strided, dilated, transposed (cropped, output-padded) and circular convolutions, an
    in-place activation on a conv output, a Flatten+Linear and a Linear head."""
    return nn.Sequential(
        nn.Conv3d(2, 4, 3, padding=1), nn.LeakyReLU(0.1, inplace=True),
        nn.Conv3d(4, 4, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv3d(4, 4, 3, dilation=2, padding=2), nn.Tanh(),
        nn.ConvTranspose3d(4, 3, 3, stride=2, padding=1, output_padding=1), nn.ReLU(),
        nn.Conv3d(3, 3, 3, padding=1, padding_mode="circular"), nn.MaxPool3d(2),
        nn.Flatten(), nn.Linear(3 * 4 * 4 * 4, 8), nn.ReLU(), nn.Linear(8, 3),
    ).double()


def model_and_opt(**kw: Any) -> tuple[nn.Module, KFAC]:
    """``build()`` seeded and a single-process float64 K-FAC on it (``kw``: settings over ``settings()``)."""
    torch.manual_seed(0)
    model = build()
    cfg = KFACConfig(**{**settings(), "factor_dtype": "float64", "inverse_dtype": "float64", **kw})
    return model, KFAC(model, None, cfg, lr=0.1, momentum=0.9)


def sample_batch(seed: int = 1, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` float64 inputs of ``SHAPE``'s sample and 3-value targets, drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, *SHAPE[1:], dtype=torch.float64, generator=gen),
            torch.randn(n, 3, dtype=torch.float64, generator=gen))


def build_unet() -> nn.Module:
    """A U-Net-like stack with a voxel-wise output: no bias, a stride-2 k2 conv down, a k2 s2
    transposed conv up, an even kernel with 'same' padding, a 1x1x1 head."""
    return nn.Sequential(
        nn.Conv3d(2, 4, 3, padding=1, bias=False), nn.ReLU(inplace=True),
        nn.Conv3d(4, 4, 2, stride=2), nn.ReLU(),
        nn.ConvTranspose3d(4, 4, 2, stride=2), nn.ReLU(),
        nn.Conv3d(4, 3, 4, padding="same"), nn.Tanh(),
        nn.Conv3d(3, 2, 1),
    ).double()


def build_serial_only() -> nn.Module:
    """Padding modes and layers that only the serial path sees (reflect, replicate, a
    Linear without bias, a transposed conv with dilation)."""
    return nn.Sequential(
        nn.Conv3d(2, 3, 3, padding=1, padding_mode="reflect"), nn.ReLU(),
        nn.Conv3d(3, 3, 3, padding=1, padding_mode="replicate"), nn.ReLU(),
        nn.ConvTranspose3d(3, 2, 3, stride=2, padding=2, dilation=2, output_padding=1), nn.ReLU(),
        nn.AvgPool3d(4), nn.Flatten(), nn.Linear(2 * 4 * 4 * 4, 3, bias=False),
    ).double()


MODELS = {"main": build, "unet": build_unet, "serial": build_serial_only}


def _target(name: str, gen: torch.Generator) -> torch.Tensor:
    shape = (SHAPE[0], 2, *SHAPE[2:]) if name == "unet" else (SHAPE[0], 3)
    return torch.randn(shape, dtype=torch.float64, generator=gen)


def _loss(out: torch.Tensor, y: torch.Tensor, grid: Any) -> torch.Tensor:
    """The mean squared error over the batch rows (and voxels) this rank's data group holds."""
    if grid is None:
        return ((out - y) ** 2).mean()
    if y.dim() == 5:  # voxel-wise: a spatial sum of the blocks' partial sums
        r0, r1 = grid.batch_range(y.shape[0])
        total = parallel.spatial_sum(((out - parallel.scatter(y, grid)) ** 2).sum(), grid)
        return total / ((r1 - r0) * y[0].numel())
    r0, r1 = grid.batch_range(y.shape[0])
    return ((out - y[r0:r1]) ** 2).mean()


def settings(**kw: Any) -> dict[str, Any]:
    base = dict(damping=1e-2, factor_interval=1, inverse_interval=2, factor_decay=0.9, kl_clip=1e-2)
    base.update(kw)
    return base


def _config(kw: dict[str, Any], exclude: tuple[str, ...]) -> KFACConfig:
    return KFACConfig(**{k: v for k, v in kw.items()}, exclude=list(exclude), factor_dtype="float64",
                      inverse_dtype="float64")


def _reference(serial: nn.Module, kw: dict[str, Any], exclude: tuple[str, ...]) -> ReferenceKFAC:
    return ReferenceKFAC(serial, lr=LR, momentum=MOMENTUM, damping=kw["damping"], factor_interval=kw["factor_interval"],
                         inverse_interval=kw["inverse_interval"], decay=kw["factor_decay"], kl_clip=kw["kl_clip"],
                         exclude=exclude)


def _batches(steps: int, seed: int, name: str = "main") -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(SHAPE, dtype=torch.float64, generator=gen), _target(name, gen)) for _ in range(steps)]


def _serial_step(model: nn.Module, ref: ReferenceKFAC, x: torch.Tensor, y: torch.Tensor) -> float:
    ref.sgd.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    return ref.step()


def _parallel_step(pmodel: nn.Module, opt: KFAC, grid: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    opt.zero_grad()
    _loss(pmodel(parallel.scatter(x, grid) if grid is not None else x), y, grid).backward()
    opt.step()
    return float(opt.last_nu) if opt.last_nu is not None else 1.0


def _compare(model: nn.Module, serial: nn.Module, what: str) -> float:
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), serial.parameters()):
        scale = max(float(q.detach().abs().max()), 1e-12)
        # An excluded Flatten+Linear is sharded at its first forward: gathered (a collective).
        err = float((whole(p, p.detach()) - q.detach()).abs().max()) / scale
        if not err <= RTOL:
            raise AssertionError(f"{what}: parameter {name}: max |grid - serial| / max |serial| = {err:.3e} > {RTOL:g}")
        worst = max(worst, err)
    return worst


def check_steps(grid: Any, steps: int, kw: dict[str, Any], exclude: tuple[str, ...] = (),
                seed: int = 0, name: str = "main", overlap: bool = False) -> dict[str, Any]:
    """``steps`` K-FAC steps at this grid (None: one process, no grid) equal the serial
    reference's, weights after each. ``overlap``: the split convolutions overlap their halo
    exchange (K-FAC's factor steps take the plain path)."""
    torch.manual_seed(seed)
    serial = MODELS[name]()
    start = copy.deepcopy(serial)
    model = copy.deepcopy(serial)
    pmodel = parallel.parallelize(model, grid, overlap_halo=overlap) if grid is not None else model
    opt = KFAC(pmodel, grid, _config(kw, exclude), lr=LR, momentum=MOMENTUM)
    ref = _reference(serial, kw, exclude)
    nus, errors = [], []
    for t, (x, y) in enumerate(_batches(steps, seed + 1, name)):
        nu_ref = _serial_step(serial, ref, x, y)
        nus.append(_parallel_step(pmodel, opt, grid, x, y))
        if abs(nus[-1] - nu_ref) > 1e-9 * nu_ref:
            raise AssertionError(f"step {t}: KL scale {nus[-1]!r} != serial {nu_ref!r}")
        errors.append(_compare(model, serial, f"step {t}"))
    return {"nus": nus, "errors": errors, "layers": [layer.name for layer in opt.layers],
            "sharded": [n for n, p in model.named_parameters() if getattr(p, "spatial_shard", False)],
            "moved": max(float((whole(p, p.detach()) - q).abs().max()) for p, q in zip(model.parameters(), start.parameters()))}


def run_and_save(grid: Any, steps: int, kw: dict[str, Any], seed: int = 0) -> bytes | None:
    """``steps`` steps, then rank 0 returns the model and optimiser state as torch.save bytes
    (taken on every rank, as the training loop does: a sharded weight and the diagonal
    blocks its ranks hold are gathered, collectives)."""
    torch.manual_seed(seed)
    model = build()
    pmodel = parallel.parallelize(model, grid)
    opt = KFAC(pmodel, grid, _config(kw, ()), lr=LR, momentum=MOMENTUM)
    for x, y in _batches(steps, seed + 1):
        _parallel_step(pmodel, opt, grid, x, y)
    state = {"model": model.state_dict(), "optimizer": gather_optimizer_state(opt, model)}
    if grid.rank != 0:
        return None
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def resume_and_check(grid: Any, saved: bytes, done: int, steps: int, kw: dict[str, Any], seed: int = 0) -> float:
    """Load a state saved after ``done`` steps (at another grid, ``weights_only=True``), run to
    ``steps`` and compare each step with the uninterrupted serial reference."""
    torch.manual_seed(seed)
    serial = build()
    ref = _reference(serial, kw, ())
    batches = _batches(steps, seed + 1)
    for x, y in batches[:done]:
        _serial_step(serial, ref, x, y)
    model = build()
    pmodel = parallel.parallelize(model, grid)
    opt = KFAC(pmodel, grid, _config(kw, ()), lr=LR, momentum=MOMENTUM)
    state = torch.load(io.BytesIO(saved), weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    worst = _compare(model, serial, "after loading")
    for t, (x, y) in enumerate(batches[done:], start=done):
        _serial_step(serial, ref, x, y)
        _parallel_step(pmodel, opt, grid, x, y)
        worst = max(worst, _compare(model, serial, f"step {t} after resuming"))
    return worst


def decompose_matches(grid: Any, dims: list[int], seed: int = 0) -> list[int]:
    """Spread eigendecompositions equal the local ones; returns each factor's owner."""
    from parallel.kfac.inverse import assign, decompose, eigen

    gen = torch.Generator().manual_seed(seed)
    mats = []
    for d in dims:
        m = torch.randn(d, d + 3, dtype=torch.float64, generator=gen)
        mats.append(m @ m.t())
    got = decompose(mats, torch.float64, grid.world_group, grid.world_size, grid.rank)
    for i, (m, (q, lam)) in enumerate(zip(mats, got)):
        q0, lam0 = eigen(m, torch.float64)
        torch.testing.assert_close(lam, lam0, rtol=0, atol=1e-12 * float(lam0.max()))
        torch.testing.assert_close(q @ torch.diag(lam) @ q.t(), m, rtol=0, atol=1e-12 * float(m.abs().max()))
    return assign([float(d) ** 3 for d in dims], grid.world_size)


def measured_traffic(grid: Any, kw: dict[str, Any]) -> dict[str, float]:
    """Bytes one K-FAC step hands to the collectives (the real ones run; they are only
    counted on the way), next to what ``kfac_costs`` predicts for this grid."""
    from parallel import comm
    from parallel.kfac import kfac_costs

    torch.manual_seed(0)
    serial = build()
    model = copy.deepcopy(serial)
    pmodel = parallel.parallelize(model, grid)
    cfg = _config(kw, ())
    opt = KFAC(pmodel, grid, cfg, lr=LR, momentum=MOMENTUM)
    seen = {"world": 0.0, "spatial": 0.0, "broadcast": 0.0}
    all_reduce, broadcast = comm.all_reduce_, comm.broadcast_

    def counting_all_reduce(t: torch.Tensor, group: Any, op: str = "sum") -> torch.Tensor:
        seen["world" if group is grid.world_group else "spatial"] += t.numel() * t.element_size()
        return all_reduce(t, group, op)

    def counting_broadcast(t: torch.Tensor, src: int, group: Any) -> torch.Tensor:
        seen["broadcast"] += t.numel() * t.element_size()
        return broadcast(t, src, group)

    comm.all_reduce_, comm.broadcast_ = counting_all_reduce, counting_broadcast
    try:
        x, y = _batches(1, 1)[0]
        _parallel_step(pmodel, opt, grid, x, y)
    finally:
        comm.all_reduce_, comm.broadcast_ = all_reduce, broadcast
    costs = kfac_costs(serial, SHAPE, cfg, grid.spatial, grid.world_size)
    return {**seen, "costs_world": costs.factor_allreduce_bytes, "costs_spatial": costs.linear_allreduce_bytes,
            "costs_broadcast": costs.broadcast_bytes}


def low_rank_serial(steps: int, kw: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """The serial run of ``check_low_rank_steps`` in this process (no process group: a
    serial optimiser inside a pool would all-reduce over the pool's world): weights and
    KL scales after each step, and what it holds low rank."""
    torch.manual_seed(seed)
    serial = build()
    opt = KFAC(serial, None, _config(kw, ()), lr=LR, momentum=MOMENTUM)
    weights, nus = [], []
    for x, y in _batches(steps, seed + 1):
        nus.append(_parallel_step(serial, opt, None, x, y))
        weights.append([p.detach().clone() for p in serial.parameters()])
    return {"weights": weights, "nus": nus, "low_rank": opt.report()["low_rank"], "staleness": opt.report()["staleness"]}


def check_low_rank_steps(grid: Any, steps: int, kw: dict[str, Any], serial: dict[str, Any], seed: int = 0
                         ) -> dict[str, Any]:
    """``steps`` K-FAC steps with low-rank factors at this grid equal the same optimiser's
    serial steps (``low_rank_serial``), weights after each; returns the layers held low rank."""
    torch.manual_seed(seed)
    model = build()
    pmodel = parallel.parallelize(model, grid)
    opt = KFAC(pmodel, grid, _config(kw, ()), lr=LR, momentum=MOMENTUM)
    return _low_rank_steps(grid, model, pmodel, opt, range(steps), serial, seed)


def _low_rank_steps(grid: Any, model: nn.Module, pmodel: nn.Module, opt: KFAC, steps: range, serial: dict[str, Any],
                    seed: int) -> dict[str, Any]:
    worst = 0.0
    batches = _batches(steps.stop, seed + 1)
    for t in steps:
        x, y = batches[t]
        nu = _parallel_step(pmodel, opt, grid, x, y)
        if abs(nu - serial["nus"][t]) > 1e-9 * serial["nus"][t]:
            raise AssertionError(f"low rank, step {t}: KL scale {nu!r} != serial {serial['nus'][t]!r}")
        for (name, p), q in zip(model.named_parameters(), serial["weights"][t]):
            err = float((whole(p, p.detach()) - q).abs().max()) / max(float(q.abs().max()), 1e-12)
            if not err <= RTOL:
                raise AssertionError(f"low rank, step {t}: parameter {name}: max |grid - serial| / max |serial| = "
                                     f"{err:.3e} > {RTOL:g}")
            worst = max(worst, err)
    report = opt.report()
    return {"low_rank": report["low_rank"], "worst": worst, "staleness": report["staleness"],
            "sharded": [n for n, p in model.named_parameters() if getattr(p, "spatial_shard", False)]}


def resume_low_rank(grid: Any, saved: bytes, done: int, steps: int, kw: dict[str, Any], serial: dict[str, Any],
                    seed: int = 0) -> dict[str, Any]:
    """Load a state saved after ``done`` steps (``run_and_save``, at another grid), run to
    ``steps`` and compare each step with the uninterrupted serial run (``low_rank_serial``)."""
    torch.manual_seed(seed)
    model = build()
    pmodel = parallel.parallelize(model, grid)
    opt = KFAC(pmodel, grid, _config(kw, ()), lr=LR, momentum=MOMENTUM)
    state = torch.load(io.BytesIO(saved), weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])  # the sharded weight's momentum is cut at its first step
    return _low_rank_steps(grid, model, pmodel, opt, range(done, steps), serial, seed)
