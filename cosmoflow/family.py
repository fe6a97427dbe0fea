"""CosmoFlow as a model family of the shared training loop: network, fields, loss, metric
and the MLPerf HPC defaults (``CosmoFlowJob()``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from cosmoflow import synthetic
from cosmoflow.fields import SPEC, transform
from cosmoflow.model import CosmoFlow, CosmoFlowConfig, mae_per_sample, mse_loss, reference_decayed
from parallel.grid import Grid
from parallel.job.config import JobConfig, OptimConfig, ScheduleConfig, TrainConfig
from parallel.job.family import Family, register


@dataclass
class CosmoFlowJob(JobConfig):
    """A CosmoFlow training job; defaults are the MLPerf HPC reference settings, its
    schedule as the reference computes it (LR held per epoch, the decay after each
    boundary, momentum in Keras' form)."""

    model: CosmoFlowConfig = field(default_factory=CosmoFlowConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(global_batch_size=64, epochs=128))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(name="sgd", lr=0.001, lr_scale_batch=64,
                                                                   momentum=0.9, momentum_form="keras"))
    sched: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(
        warmup_epochs=4, decay="step", decay_epochs=[32, 64], decay_factors=[0.25, 0.125], per_epoch=True,
        decay_boundary="after"))


def build(cfg: CosmoFlowConfig, volume: tuple[int, int, int]) -> CosmoFlow:
    return CosmoFlow(cfg, volume)


def loss(pred: torch.Tensor, target: torch.Tensor, grid: Grid) -> torch.Tensor:
    """MSE of the replicated (n, 4) prediction: no spatial reduction needed."""
    return mse_loss(pred, target)


def metric(pred: torch.Tensor, target: torch.Tensor, grid: Grid) -> torch.Tensor:
    return mae_per_sample(pred, target)


def synthetic_sample(seed: int, split: int, index: int, size: int) -> dict[str, np.ndarray]:
    """One synthetic universe as field arrays (for the I/O benchmarks)."""
    volume, target = synthetic.sample(seed, split, index, size)
    return {"volume": volume, "target": target}


FAMILY = register(Family(
    name="cosmoflow", config_class=CosmoFlowJob, build_model=build, spec=SPEC,
    input_field="volume", target_field="target", loss=loss, metric=metric,
    metric_name="mae", goal="min", target=0.124, mlperf_eval_key="eval_error", transform=transform,
    prepare="python -m cosmoflow.prepare", bench_overrides=(),
    tiny_overrides=("model.n_conv_blocks=1", "model.conv_filters=2", "model.dense_sizes=[2]"),
    synthetic=synthetic_sample, decayed=reference_decayed,  # type: ignore[arg-type]
))
