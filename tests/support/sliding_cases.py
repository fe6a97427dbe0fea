"""Rank-side halves of the sliding-window tests (run by RankPool), and the tests' own
serial sliding window, written from the MLPerf reference's description (not its code):
keep, pad with -2.2, Gaussian-weighted logits over windows at stride w/2, cut back,
argmax, Dice per foreground class averaged per case and over cases."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

import parallel
from parallel.grid import Grid

CLASSES = 3
SMOOTH = 1e-6


def small_unet() -> torch.nn.Module:
    """A fixed float64 U-Net (two levels, instance norm: each window's statistics span it)."""
    from unet3d.model import UNet3D, UNet3DConfig

    torch.manual_seed(3)
    return UNet3D(UNet3DConfig(depth=2, base_filters=4, max_filters=8)).double()


def reference_dice(model: torch.nn.Module, image: np.ndarray, label: np.ndarray, window: int) -> float:
    """Mean foreground Dice of one case, from the description of the reference procedure."""
    stride = window // 2
    x = torch.from_numpy(image).double()[None]  # (1, 1, D, H, W)
    y = torch.from_numpy(label).long()
    lows, highs = [], []
    for n in x.shape[2:]:
        rest = n % stride
        cut = rest if rest < stride // 2 else 0  # a short remainder is dropped, centred
        lows.append(cut // 2)
        highs.append(n - (cut - cut // 2))
    x = x[:, :, lows[0]:highs[0], lows[1]:highs[1], lows[2]:highs[2]]
    y = y[lows[0]:highs[0], lows[1]:highs[1], lows[2]:highs[2]]
    kept = x.shape[2:]
    pads = []
    for m in kept:
        extra = (stride - m % stride) % stride
        if m + extra < window:
            extra += stride
        pads.append((extra // 2, extra - extra // 2))
    x = torch.nn.functional.pad(x, [pads[2][0], pads[2][1], pads[1][0], pads[1][1], pads[0][0], pads[0][1]],
                                value=-2.2)
    k = np.arange(window) - (window - 1) / 2
    g = np.exp(-(k ** 2) / (2 * (0.125 * window) ** 2))
    cube = np.cbrt(np.einsum("i,j,k->ijk", g, g, g))
    weight = torch.from_numpy(cube / cube.max())
    acc = torch.zeros(1, CLASSES, *x.shape[2:], dtype=torch.float64)
    norm = torch.zeros(x.shape[2:], dtype=torch.float64)
    with torch.no_grad():
        for d in range(0, x.shape[2] - window + 1, stride):
            for h in range(0, x.shape[3] - window + 1, stride):
                for w in range(0, x.shape[4] - window + 1, stride):
                    box = (slice(d, d + window), slice(h, h + window), slice(w, w + window))
                    acc[(slice(None), slice(None)) + box] += model(x[(slice(None), slice(None)) + box]) * weight
                    norm[box] += weight
    logits = (acc / norm)[:, :, pads[0][0]:pads[0][0] + kept[0], pads[1][0]:pads[1][0] + kept[1],
                          pads[2][0]:pads[2][0] + kept[2]]
    pred = logits.argmax(1)[0]
    dice = []
    for c in range(1, CLASSES):
        p, t = pred == c, y == c
        dice.append((2 * (p & t).sum().item() + SMOOTH) / (p.sum().item() + t.sum().item() + SMOOTH))
    return float(np.mean(dice))


def write_cases(root: Path, shapes: Sequence[Sequence[int]], seed: int = 0) -> list[Path]:
    """U-Net sample files of the given shapes: smooth random images, labels from them."""
    from parallel.data.foreground import foreground_boxes
    from parallel.data.format import write_samples
    from unet3d.fields import SPEC

    rng = np.random.default_rng(seed)
    paths = []
    for i, shape in enumerate(shapes):
        noise = torch.from_numpy(rng.normal(size=(1, 1, *shape)))
        smooth = torch.nn.functional.avg_pool3d(noise, 5, 1, 2, count_include_pad=False)[0].numpy()
        image = (smooth / smooth.std()).astype(np.float32)
        label = np.digitize(image[0], [0.3, 1.2]).astype(np.uint8)
        path = root / f"case_{i:05d}.h5"
        write_samples(path, SPEC, {"image": image[None], "label": label[None],
                                   "fg_boxes": foreground_boxes(label, CLASSES)[None]},
                      attrs={"intensity": "normalized"})
        paths.append(path)
    return paths


def sliding_dice(grid: Grid, files: list[str], window: int, mode: str = "sliding", average: str = "cases") -> float:
    """Mean Dice of the fixed model over the files, evaluated at this grid."""
    from parallel.data import BlockDataset, ShardSampler, make_loader
    from parallel.infer import WindowCrop, evaluate_cases
    from unet3d.fields import normalized_transform
    from unet3d.losses import dice_per_sample

    model = parallel.parallelize(small_unet(), grid, seed=0)
    regions = WindowCrop((window,) * 3) if mode == "sliding" else None
    ds = BlockDataset(files, fields=("image", "label"), grid=grid, transform=normalized_transform, regions=regions)
    loader = make_loader(ds, ShardSampler(len(ds), grid), num_workers=0)
    out = evaluate_cases(lambda x: model(x.double()), loader, grid, input_field="image", target_field="label",
                         metric=dice_per_sample, mode=mode, window=(window,) * 3,  # type: ignore[arg-type]
                         average=average)  # type: ignore[arg-type]
    assert out["samples"] == (len(files) if average == "cases" else min(grid.data_size, len(files)))
    return out["metric"]


def whole_dice_serial(files: list[str]) -> float:
    """Whole-volume inference of the fixed model, serially, for comparison."""
    import h5py

    from unet3d.losses import dice_per_sample

    model = small_unet()
    scores = []
    for path in files:
        with h5py.File(path, "r") as f:
            x, y = torch.from_numpy(f["image"][...]).double(), torch.from_numpy(f["label"][...]).long()
        with torch.no_grad():
            scores.append(float(dice_per_sample(model(x), y)[0]))
    return float(np.mean(scores)) if scores else math.nan
