"""Rank functions for tests/unit/test_device_paths.py and tests/ranks/test_random_draws.py."""

from __future__ import annotations

import copy

import torch

from parallel.grid import Grid


def step_grid_devices(grid: Grid) -> list[str]:
    """The devices of the step benchmark's serial and data grids when the job's grid is on
    ``cuda:0`` (a device object only: nothing is allocated on it)."""
    from parallel.bench.step import step_grids

    on_gpu = copy.copy(grid)
    on_gpu.device = torch.device("cuda", 0)
    return [str(g.device) for g in step_grids(on_gpu)]


def efficientnet_stochastic_depth(grid: Grid, shape: tuple[int, ...]) -> dict[str, float]:
    """MONAI's EfficientNet-B0 in training mode with stochastic depth on (float64): verified
    against its serial self at ``parallelize``, the global stream left where it was, and a
    forward from a seed equal to the serial forward from that seed."""
    import parallel
    from monai.networks.nets import EfficientNetBN
    from monai.networks.nets.efficientnet import MBConvBlock

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        serial = EfficientNetBN("efficientnet-b0", spatial_dims=3, in_channels=1, num_classes=2).train()
        rates = [m.drop_connect_rate for m in serial.modules() if isinstance(m, MBConvBlock) and m.drop_connect_rate]
        assert len(rates) >= 10 and max(rates) > 0.15, rates  # B0's blocks, from 0 to 0.2 by depth
        # The head's nn.Dropout is converted to a dropout with a stream of its own (parallel.layers.dropout):
        # this case is about the draws in the network's own forward.
        serial._dropout.p = 0.0
        state = torch.get_rng_state()
        pmodel = parallel.parallelize(copy.deepcopy(serial), grid, verify=shape)  # raises if it differs
        assert torch.equal(torch.get_rng_state(), state), "verification moved the global stream"
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.manual_seed(5)
            ref = serial(x)
            torch.manual_seed(5)
            out = pmodel(parallel.scatter(x, grid))
            torch.manual_seed(6)
            other = serial(x)
        return {"split": float((out - ref).abs().max() / ref.abs().max()),
                "another_seed": float((other - ref).abs().max() / ref.abs().max())}
    finally:
        torch.set_default_dtype(previous)


def noise_is_stopped_by_verify(grid: Grid) -> str:
    """``parallelize(..., verify=probe)`` of a network adding volume-shaped noise: the message."""
    import parallel
    from parallel.verify import VerificationError
    from random_models import NoisyNet

    torch.manual_seed(0)
    try:
        parallel.parallelize(NoisyNet().train(), grid, verify=(1, 4, 8, 8, 8))
    except VerificationError as err:
        return str(err)
    raise AssertionError("NoisyNet passed verification")


def audited_steps(grid: Grid, family: str, data_dir: str, run_dir: str, overrides: list[str]) -> list[dict]:
    """Train through the job's real loop (``build_job(...).run()``) with its ``TrainStep``
    audited: each step's collectives and host reads (tests/support/step_audit.py)."""
    from hydra import compose, initialize_config_dir

    from parallel.train.cli import CONFIG_ROOT, register
    from parallel.job.config import to_dataclass
    from parallel.job.family import get
    from parallel.train.checks import before_grid
    from parallel.train.job import build_job
    from parallel.train.persist.writer import Writer
    from step_audit import AuditedStep

    fam = get(family)
    register(fam)
    with initialize_config_dir(config_dir=str(CONFIG_ROOT / family), version_base=None):
        cfg = to_dataclass(compose(config_name="quickstart", overrides=[
            f"data.dir={data_dir}", f"run.dir={run_dir}", f"parallel.spatial={list(grid.spatial)}", *overrides]),
            fam.config_class)
    job = build_job(cfg, fam, grid, before_grid(cfg, fam), Writer(background=False))
    audited = AuditedStep(job.loop.step)
    job.loop.step = audited  # type: ignore[assignment]
    job.run()
    return audited.per_step
