"""The optimisers and learning-rate schedules (``parallel/train/optim.py``): the MLPerf
CosmoFlow and U-Net schedules, a decay that does not fit refused, each optimiser built.
(As the references compute them, step by step: tests/unit/test_schedule_reference.py.)"""

import pytest
import torch

from cosmoflow.family import CosmoFlowJob
from parallel.job.config import OptimConfig, ScheduleConfig
from parallel.train.optim import Schedule, build_optimizer
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
