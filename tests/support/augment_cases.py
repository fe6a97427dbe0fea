"""Rank-side checks of parallel.data.augment and the U-Net augmentation (run by RankPool)."""

from __future__ import annotations

import torch

import parallel
from parallel.grid import Grid


def check_flip(grid: Grid, shape: tuple[int, ...], dims: tuple[int, ...]) -> None:
    """The flipped blocks gather to torch.flip of the whole tensor."""
    from parallel.data.augment import flip

    full = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = parallel.gather(flip(parallel.scatter(full, grid), dims, grid), grid)
    assert torch.equal(got, full.flip(dims)), f"flip {dims} at spatial {grid.spatial} differs"


def unet_augment(grid: Grid, shape: tuple[int, ...], probs: dict[str, float], seed: int) -> dict[str, torch.Tensor]:
    """The U-Net augmentation of a fixed global batch, gathered (the same on every rank)."""
    from unet3d.family import UNet3DJob, augment

    gen = torch.Generator().manual_seed(0)
    image = torch.randn(shape, generator=gen)
    label = torch.randint(0, 3, (shape[0], *shape[2:]), generator=gen)
    cfg = UNet3DJob()
    for k, v in probs.items():
        setattr(cfg.augment, k, v)
    local = {"image": parallel.scatter(image, grid),
             "label": parallel.scatter(label[:, None], grid)[:, 0]}
    out = augment(local, torch.Generator().manual_seed(seed), grid, cfg)
    return {"image": parallel.gather(out["image"], grid),
            "label": parallel.gather(out["label"][:, None], grid)[:, 0],
            "input_image": image, "input_label": label}
