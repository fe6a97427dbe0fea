"""Pure logic of the training loop: schedules, Hydra configs, checkpoint files."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from cosmoflow.family import FAMILY as COSMO
from cosmoflow.family import CosmoFlowJob
from parallel.grid import Grid
from parallel.job import checkpoint
from parallel.job.config import OptimConfig, ScheduleConfig, to_dataclass
from parallel.train.cli import CONFIG_ROOT, register
from parallel.train.optim import Schedule, build_optimizer
from parallel.train.persist import rng, writer
from unet3d.family import FAMILY as UNET
from unet3d.family import UNet3DJob


def test_mlperf_cosmoflow_schedule():
    job = CosmoFlowJob()
    s = Schedule(job.sched, job.optim, global_batch_size=128, steps_per_epoch=10, epochs=128)
    assert s.lr(0) == pytest.approx(0.001)            # warmup starts at the unscaled LR
    assert s.lr(25) == pytest.approx(0.001 + (0.002 - 0.001) * 0.5)  # epoch 2, held all epoch
    assert s.lr(40) == pytest.approx(0.002)           # 0.001 x 128 / 64 after 4 epochs
    assert s.lr(329) == pytest.approx(0.002)          # epoch 32 (0-based): the reference decays after it
    assert s.lr(330) == pytest.approx(0.002 * 0.25)
    assert s.lr(650) == pytest.approx(0.002 * 0.125)  # epoch 65: replaces 0.25, no product


def test_mlperf_unet_warmup_and_cosine():
    job = UNet3DJob()
    s = Schedule(job.sched, job.optim, job.train.global_batch_size, steps_per_epoch=2, epochs=4000)
    assert s.lr(0) == pytest.approx(1e-4 + (0.8 - 1e-4) / 200)  # epoch 1 (1-based) of 200
    assert s.lr(198) == pytest.approx(1e-4 + (0.8 - 1e-4) * 0.5)
    assert s.lr(398) == pytest.approx(0.8) and s.lr(5000) == pytest.approx(0.8)
    cos = Schedule(ScheduleConfig(decay="cosine", min_lr=0.01), OptimConfig(lr=1.0), 8, 10, 5)
    assert cos.lr(0) == pytest.approx(1.0) and cos.lr(25) == pytest.approx(0.505) and cos.lr(50) == pytest.approx(0.01)


def test_schedule_rejects_mismatched_decay():
    with pytest.raises(ValueError, match="decay_epochs has 2 entries but sched.decay_factors has 1"):
        Schedule(ScheduleConfig(decay="step", decay_epochs=[1, 2], decay_factors=[0.5]), OptimConfig(), 8, 10, 5)


def test_optimizers():
    p = [torch.nn.Parameter(torch.zeros(2))]
    sgd = build_optimizer(p, OptimConfig(name="sgd", nesterov=True, momentum=0.9))
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["nesterov"]
    assert isinstance(build_optimizer(p, OptimConfig(name="adamw", weight_decay=0.02)), torch.optim.AdamW)


@pytest.mark.parametrize("family,name", [(COSMO, "default"), (COSMO, "quickstart"), (COSMO, "mlperf512"),
                                         (UNET, "default"), (UNET, "quickstart")])
def test_configs_compose_with_overrides(family, name):
    register(family)
    with initialize_config_dir(config_dir=str(CONFIG_ROOT / family.name), version_base=None):
        cfg = compose(config_name=name, overrides=[
            "parallel.spatial=[2,2,1]", "train.global_batch_size=12", "train.epochs=3", "train.max_steps=7",
            "train.seed=5", "train.resume=true", "run.dir=/tmp/x", "data.dir=/tmp/d", "optim.name=adamw"])
    job = to_dataclass(cfg, family.config_class)
    assert job.parallel.spatial == [2, 2, 1] and job.train.global_batch_size == 12
    assert (job.train.epochs, job.train.max_steps, job.train.seed, job.train.resume) == (3, 7, 5, True)
    assert job.run.dir == "/tmp/x" and job.data.dir == "/tmp/d" and job.optim.name == "adamw"
    assert type(job.model).__name__ == ("CosmoFlowConfig" if family is COSMO else "UNet3DConfig")


def test_config_rejects_bad_values():
    register(COSMO)
    with initialize_config_dir(config_dir=str(CONFIG_ROOT / "cosmoflow"), version_base=None):
        with pytest.raises((ConfigCompositionException, ValidationError), match="adam"):
            compose(config_name="default", overrides=["optim.name=adam"])
        cfg = compose(config_name="default", overrides=["model.dropout=0.25"])
    assert to_dataclass(cfg, CosmoFlowJob).model.dropout == 0.25


def test_checkpoint_is_atomic_and_weights_only(tmp_path):
    grid = Grid((1, 1, 1), 1, 0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Dropout(0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    path = checkpoint.checkpoint_path(tmp_path)
    torch.manual_seed(7)
    writer.save(path, grid, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3})
    expected = torch.rand(4)
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]  # no temporary left behind
    ckpt = checkpoint.load(path)  # weights_only=True inside
    assert ckpt["step"] == 3 and torch.equal(ckpt["model"]["0.weight"], model[0].weight)
    torch.manual_seed(0)
    assert rng.restore_rng(ckpt, grid, seed=0)
    assert torch.equal(torch.rand(4), expected)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        checkpoint.load(tmp_path / "missing.pt")
