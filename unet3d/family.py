"""The 3D U-Net as a model family of the shared training loop: network, fields,
Dice + cross-entropy loss, mean-Dice metric and the MLPerf Training defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parallel.grid import Grid
from parallel.train.config import JobConfig, OptimConfig, ScheduleConfig, TrainConfig
from parallel.train.family import Family
from unet3d.fields import transform, transform_for
from unet3d.losses import dice_ce_loss, dice_per_sample
from unet3d.model import UNet3D, UNet3DConfig


@dataclass
class UNet3DJob(JobConfig):
    """A 3D U-Net training job; defaults follow the MLPerf Training reference (KiTS19)."""

    model: UNet3DConfig = field(default_factory=UNet3DConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(global_batch_size=2, epochs=4000,
                                                                   eval_every=20))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(name="sgd", lr=0.8, momentum=0.9,
                                                                   nesterov=True))
    sched: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(warmup_epochs=200,
                                                                         warmup_start_lr=1e-4))


def build(cfg: UNet3DConfig, volume: tuple[int, int, int]) -> UNet3D:
    m = 2**cfg.depth
    if any(v % m for v in volume):
        raise ValueError(f"model.depth={cfg.depth} needs volumes that are multiples of {m} along D, H, W; "
                         f"the data's volume is {tuple(volume)}")
    return UNet3D(cfg)


def loss(logits: torch.Tensor, labels: torch.Tensor, grid: Grid) -> torch.Tensor:
    return dice_ce_loss(logits, labels, grid)


def metric(logits: torch.Tensor, labels: torch.Tensor, grid: Grid) -> torch.Tensor:
    return dice_per_sample(logits, labels, grid)


FAMILY = Family(
    name="unet3d", config_class=UNet3DJob, build_model=build, input_field="image", target_field="label",
    loss=loss, metric=metric, metric_name="mean_dice", goal="max", target=0.908,
    mlperf_eval_key="eval_accuracy", transform=transform, transform_for=transform_for,
)
