"""Learning rates and optimiser steps as the MLPerf references compute them. (The loop
setting them at every step: tests/launch/test_schedule_loop.py.)"""

import pytest
import torch
from hydra import compose, initialize_config_dir

from cosmoflow.family import FAMILY as COSMO
from cosmoflow.family import CosmoFlowJob
from cosmoflow.model import CosmoFlow, CosmoFlowConfig, reference_decayed
from parallel.job.config import OptimConfig, ScheduleConfig, to_dataclass
from parallel.train.checks.config import check_schedule
from parallel.train.cli import CONFIG_ROOT, register
from parallel.train.optim import KerasSGD, Schedule, build_optimizer
from schedules import hpc_reference_lr
from unet3d.family import FAMILY as UNET
from unet3d.family import UNet3DJob

TRAIN_SAMPLES = 524288  # MLPerf HPC CosmoFlow's training set


@pytest.mark.parametrize("batch", [64, 512])
def test_cosmoflow_lr_is_the_hpc_reference_at_every_step_of_70_epochs(batch):
    job = CosmoFlowJob()
    spe = TRAIN_SAMPLES // batch
    s = Schedule(job.sched, job.optim, batch, steps_per_epoch=spe, epochs=128)
    for epoch in range(70):
        want = hpc_reference_lr(epoch, batch)
        for step in range(epoch * spe, (epoch + 1) * spe):
            assert s.lr(step) == pytest.approx(want, rel=1e-12), (batch, epoch, step)
    assert s.lr(33 * spe - 1) == pytest.approx(0.001 * batch / 64)  # epoch 32 (0-based) is not yet decayed
    assert s.lr(33 * spe) == pytest.approx(0.001 * batch / 64 * 0.25)


def test_decay_at_the_boundary_is_an_option():
    sched = ScheduleConfig(warmup_epochs=4, decay="step", decay_epochs=[32, 64], decay_factors=[0.25, 0.125],
                           per_epoch=True, decay_boundary="at")
    s = Schedule(sched, OptimConfig(lr=0.001, lr_scale_batch=64), 512, steps_per_epoch=10, epochs=128)
    assert s.lr(319) == pytest.approx(0.008) and s.lr(320) == pytest.approx(0.002)
    assert s.lr(5) == pytest.approx(0.001)  # held for the whole first epoch


def test_unet_warmup_is_set_once_per_epoch_from_1_based_epochs():
    job = UNet3DJob()
    spe = 84  # 168 cases, batch 2
    s = Schedule(job.sched, job.optim, job.train.global_batch_size, steps_per_epoch=spe, epochs=4000)
    for epoch in range(1, 251):  # the reference's lr_warmup(epoch) before each epoch, 1-based
        want = 1e-4 + (0.8 - 1e-4) * epoch / 200 if epoch <= 200 else 0.8
        for step in range((epoch - 1) * spe, epoch * spe):
            assert s.lr(step) == pytest.approx(want, rel=1e-12), (epoch, step)


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(5, dtype=torch.float64)) for _ in range(2)]


@pytest.mark.parametrize("nesterov", [False, True])
def test_keras_momentum_keeps_the_learning_rate_in_the_velocity(nesterov):
    params = _params()
    ref = [p.detach().clone() for p in params]
    velocity = [torch.zeros_like(p) for p in ref]
    opt = build_optimizer(params, OptimConfig(lr=0.1, momentum=0.9, nesterov=nesterov, momentum_form="keras",
                                              weight_decay=0.01))
    assert isinstance(opt, KerasSGD)
    gen = torch.Generator().manual_seed(1)
    for step, lr in enumerate([0.1, 0.1, 0.5, 0.02, 0.3]):
        grads = [torch.randn(5, generator=gen, dtype=torch.float64) for _ in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        for i, g in enumerate(grads):  # Keras: v = m v - lr g; p += v (+ m v - lr g with Nesterov)
            g = g + 0.01 * ref[i]
            velocity[i] = 0.9 * velocity[i] - lr * g
            ref[i] = ref[i] + (0.9 * velocity[i] - lr * g if nesterov else velocity[i])
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.detach(), r, rtol=1e-14, atol=1e-15)
    # torch's form (b = m b + g; p -= lr b) differs once the learning rate has changed
    other = _params()
    torch_opt = build_optimizer(other, OptimConfig(lr=0.1, momentum=0.9, nesterov=nesterov, weight_decay=0.01))
    assert isinstance(torch_opt, torch.optim.SGD)
    gen = torch.Generator().manual_seed(1)
    for lr in [0.1, 0.1, 0.5, 0.02, 0.3]:
        for p in other:
            p.grad = torch.randn(5, generator=gen, dtype=torch.float64)
        for group in torch_opt.param_groups:
            group["lr"] = lr
        torch_opt.step()
    assert not torch.allclose(other[0], params[0], rtol=1e-6)


def test_keras_and_torch_momentum_agree_at_a_constant_rate():
    a, b = _params(), _params()
    oa = build_optimizer(a, OptimConfig(lr=0.05, momentum=0.9, momentum_form="keras"))
    ob = build_optimizer(b, OptimConfig(lr=0.05, momentum=0.9, momentum_form="torch"))
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        grads = [torch.randn(5, generator=gen, dtype=torch.float64) for _ in a]
        for p, q, g in zip(a, b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        oa.step(), ob.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-13, atol=1e-15)


def test_weight_decay_only_on_the_hidden_dense_weights():
    torch.manual_seed(0)
    model = CosmoFlow(CosmoFlowConfig(n_conv_blocks=2, conv_filters=4), 16).double()
    names = reference_decayed(model)
    assert names == ["head.1.weight", "head.4.weight"]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model.named_parameters(), OptimConfig(lr=0.1, momentum=0.0, weight_decay=0.5,
                                                               momentum_form="keras"), decayed=names)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        if n in names:
            torch.testing.assert_close(p.detach(), before[n] * (1 - 0.1 * 0.5))
        else:
            assert torch.equal(p.detach(), before[n]), n
    with pytest.raises(ValueError, match="head.9.weight"):
        build_optimizer(model.named_parameters(), OptimConfig(weight_decay=0.1), decayed=["head.9.weight"])


def test_a_warmup_that_lowers_the_rate_is_a_config_error():
    with pytest.raises(ValueError, match=r"starts at optim.lr \(sched.warmup_start_lr unset\) = 0.001, above its "
                                         r"peak 0.00025 = optim.lr=0.001 x train.global_batch_size=16"):
        check_schedule(ScheduleConfig(warmup_epochs=4), OptimConfig(lr=0.001, lr_scale_batch=64), 16)
    check_schedule(ScheduleConfig(warmup_epochs=4), OptimConfig(lr=0.001, lr_scale_batch=64), 64)  # flat: allowed


@pytest.mark.parametrize("family,name", [(COSMO, "default"), (COSMO, "quickstart"), (COSMO, "mlperf512"),
                                         (COSMO, "smoke"), (UNET, "default"), (UNET, "quickstart"),
                                         (UNET, "smoke")])
def test_every_shipped_schedule_passes_the_check(family, name):
    register(family)
    with initialize_config_dir(config_dir=str(CONFIG_ROOT / family.name), version_base=None):
        job = to_dataclass(compose(config_name=name), family.config_class)
    check_schedule(job.sched, job.optim, job.train.global_batch_size)
