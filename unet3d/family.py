"""The 3D U-Net as a model family of the shared training loop: network, fields,
Dice + cross-entropy loss, mean-Dice metric and the MLPerf Training defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from parallel.data import augment as spatial_augment
from parallel.grid import Grid
from parallel.job.config import (
    DataConfig,
    EvalConfig,
    JobConfig,
    MLPerfConfig,
    OptimConfig,
    ScheduleConfig,
    TrainConfig,
)
from parallel.job.family import Family, register
from parallel.layers.shapes import input_volume
from unet3d.fields import SPEC, transform, transform_for
from unet3d.losses import dice_ce_loss, dice_per_sample
from unet3d.model import UNet3D, UNet3DConfig


class BrightnessForm(str, Enum):
    """How a brightness augmentation scales the image (a str Enum: configs validate it)."""

    reference = "reference"
    intended = "intended"

    def __str__(self) -> str:
        return str(self.value)


def brightness_scale(u: float, brightness: float, form: BrightnessForm | str) -> float:
    """The factor an image is multiplied by, from a uniform draw ``u`` in [0, 1).

    ``reference``: what the MLPerf reference's RandomBrightnessAugmentation computes,
    ``1 + U(1 - b, 1 + b)`` (x1.7 to x2.3 for b = 0.3: it adds 1 to a factor already
    around 1); ``intended``: ``U(1 - b, 1 + b)``, a change of at most +-b.
    """
    factor = 1.0 + brightness * (2.0 * u - 1.0)
    return 1.0 + factor if str(form) == "reference" else factor


@dataclass
class AugmentConfig:
    """Training-time augmentation as in the MLPerf U-Net reference (section ``augment``).

    Each sample draws its own flips, brightness and noise from the step's seed and its row
    in the global batch, so the augmented batch is the same at every grid; flips of a
    split volume fetch the mirrored blocks from their owners (``parallel.data.augment``). With
    training crops (``data.crop``) the augmentation applies to the crop, as in the reference
    (crop, then flips, brightness, noise).
    """

    enabled: bool = True
    """Augment training batches (never validation)."""
    flip_prob: float = 1.0 / 3.0
    """Probability of flipping each of D, H and W."""
    brightness_prob: float = 0.1
    """Probability of scaling the image (see ``brightness_form``)."""
    brightness: float = 0.3
    """Half-width ``b`` of the uniform factor U(1 - b, 1 + b)."""
    brightness_form: BrightnessForm = BrightnessForm.reference
    """``reference``: multiply by 1 + U(1 - b, 1 + b), as the MLPerf reference code does
    (x1.7 to x2.3); ``intended``: multiply by U(1 - b, 1 + b)."""
    noise_prob: float = 0.1
    """Probability of adding Gaussian noise of a standard deviation drawn from [0, noise_std]."""
    noise_std: float = 0.1
    """Largest noise standard deviation (on the normalised image)."""


@dataclass
class UNet3DJob(JobConfig):
    """A 3D U-Net training job; defaults follow the MLPerf Training reference (KiTS19)."""

    model: UNet3DConfig = field(default_factory=UNet3DConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(crop=[128, 128, 128], oversampling=0.4))
    # the reference's metric: sliding window of the crop, from epoch 1000 every 20 epochs,
    # the mean of its ranks' means (each reference rank is one data group here)
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(mode="sliding", start_epoch=1000, average="groups"))
    train: TrainConfig = field(default_factory=lambda: TrainConfig(global_batch_size=2, epochs=4000,
                                                                   eval_every=20))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(name="sgd", lr=0.8, momentum=0.9,
                                                                   nesterov=True))
    sched: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(warmup_epochs=200, warmup_start_lr=1e-4,
                                                                         per_epoch=True, warmup_epoch_offset=1))
    mlperf: MLPerfConfig = field(default_factory=lambda: MLPerfConfig(usage="training"))


def build(cfg: UNet3DConfig, volume: tuple[int, int, int]) -> UNet3D:
    m = 2**cfg.depth
    if any(v % m for v in volume):
        raise ValueError(f"model.depth={cfg.depth} needs volumes that are multiples of {m} (its total stride) "
                         f"along D, H, W, got {tuple(int(v) for v in volume)}")
    return UNet3D(cfg)


def loss(logits: torch.Tensor, labels: torch.Tensor, grid: Grid) -> torch.Tensor:
    return dice_ce_loss(logits, labels, grid)


def metric(logits: torch.Tensor, labels: torch.Tensor, grid: Grid) -> torch.Tensor:
    return dice_per_sample(logits, labels, grid)


def augment(batch: dict[str, torch.Tensor], gen: torch.Generator, grid: Grid,
            cfg: UNet3DJob) -> dict[str, torch.Tensor]:
    """Random flips, brightness and Gaussian noise of this rank's part of the batch.

    Collective over the spatial group (flips along split dims, and the volume's global
    shape where the training loop has not declared it); every data group holds as many rows.
    """
    aug = cfg.augment
    image, label = batch["image"], batch["label"]
    if not aug.enabled or image.dim() != 5:
        return batch
    n = image.shape[0]
    # every data group holds the same number of rows (train.global_batch_size divides into
    # them: build_data checks it), so each group's offset needs no exchange of counts
    offset, total = n * grid.data_rank, n * grid.data_size
    if n == 0:  # the whole spatial group holds no rows this step: nothing to exchange
        return batch
    # every rank draws the whole global batch's choices and keeps its own rows
    # drawn by a CPU generator and read once as Python numbers (host data on every device)
    draws = torch.rand(total, 7, generator=gen, dtype=torch.float64)[offset:offset + n].tolist()
    keys = torch.randint(0, 2**31 - 1, (total,), generator=gen)[offset:offset + n].tolist()
    volume = input_volume(image, grid, "unet3d augment")  # the training loop declares it: no gather
    block = grid.block_range(volume) if grid.spatial_size > 1 else [(0, v) for v in volume]
    images, labels = [], []
    for i in range(n):
        x, y = image[i:i + 1], label[i:i + 1].unsqueeze(1)
        dims = [d for d in (2, 3, 4) if draws[i][d - 2] < aug.flip_prob]
        x = spatial_augment.flip(x, dims, grid, volume)
        y = spatial_augment.flip(y, dims, grid, volume)
        if draws[i][3] < aug.brightness_prob:
            x = x * brightness_scale(draws[i][4], aug.brightness, aug.brightness_form)
        if draws[i][5] < aug.noise_prob:
            noise = spatial_augment.voxel_noise(keys[i], x.shape[1], block, volume, x.device)
            x = x + float(aug.noise_std * draws[i][6]) * noise.to(x.dtype)[None]
        images.append(x)
        labels.append(y.squeeze(1))
    out = dict(batch)
    out["image"], out["label"] = torch.cat(images), torch.cat(labels)
    return out


FAMILY = register(Family(
    name="unet3d", config_class=UNet3DJob, build_model=build, spec=SPEC, input_field="image", target_field="label",
    loss=loss, metric=metric, metric_name="mean_dice", goal="max", target=0.908,
    mlperf_eval_key="eval_accuracy", transform=transform, transform_for=transform_for, augment=augment,
    prepare="python -m unet3d.prepare", bench_overrides=("model.depth=3", "model.base_filters=8"),
    tiny_overrides=("model.depth=1", "model.base_filters=2"), crop_boxes="fg_boxes",
))
