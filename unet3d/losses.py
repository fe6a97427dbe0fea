"""Dice + cross-entropy loss and mean-Dice metric, from sums reduced over the grid.

Each rank holds one block of each sample's logits and labels. Every quantity the loss
and metric need is a sum over voxels (Dice intersections, prediction and label sums,
the cross-entropy sum, the voxel count), so each rank sums over its block, one
``parallel.spatial_sum`` adds the partial sums over the spatial group, and the rest is
arithmetic on small replicated tensors. The volume is never gathered. With no grid (or a
world of one) the same code is the serial loss.

Conventions follow the MLPerf reference (MONAI-style ``DiceCELoss``): softmax
probabilities against one-hot labels, Dice per sample and per class, background
excluded, smooth 1e-6 in numerator and denominator, loss = (Dice loss + CE) / 2.
The metric is the Dice of argmax predictions per sample, averaged over the foreground
classes (KiTS19: kidney and tumour).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel.comm import spatial_sum
from parallel.grid import Grid

SMOOTH = 1e-6


def _labels(labels: torch.Tensor) -> torch.Tensor:
    """(n, 1, d, h, w) or (n, d, h, w) integer labels -> (n, d, h, w) int64."""
    if labels.dim() == 5:
        if labels.shape[1] != 1:
            raise ValueError(f"labels must have one channel, got shape {tuple(labels.shape)}")
        labels = labels[:, 0]
    return labels.long()


def _reduce(x: torch.Tensor, grid: Grid | None) -> torch.Tensor:
    return x if grid is None or grid.spatial_size == 1 else spatial_sum(x, grid)


def dice_ce_loss(logits: torch.Tensor, labels: torch.Tensor, grid: Grid | None = None,
                 include_background: bool = False) -> torch.Tensor:
    """(mean Dice loss + mean cross-entropy) / 2 over the local batch.

    ``logits`` (n, K, d, h, w) and ``labels`` are this rank's block; the result is the
    loss of the whole volumes, identical on every rank of the spatial group.
    """
    labels = _labels(labels)
    n, k = logits.shape[:2]
    # low precision (autocast's bf16/fp16) summed in float32; float64 (train.precision=fp64) kept
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    probs = torch.softmax(logits, dim=1)
    onehot = F.one_hot(labels, k).movedim(-1, 1).to(probs.dtype)
    dims = (2, 3, 4)
    inter = (probs * onehot).sum(dims)
    psum = probs.sum(dims)
    tsum = onehot.sum(dims)
    ce = F.cross_entropy(logits, labels, reduction="none").sum((1, 2, 3))
    voxels = torch.full((n,), float(labels[0].numel()), dtype=probs.dtype, device=probs.device)
    # One collective for all partial sums: (n, 3K + 2).
    sums = _reduce(torch.cat([inter, psum, tsum, ce[:, None], voxels[:, None]], dim=1), grid)
    inter, psum, tsum = sums[:, :k], sums[:, k:2 * k], sums[:, 2 * k:3 * k]
    ce_sum, count = sums[:, 3 * k], sums[:, 3 * k + 1]
    dice = (2 * inter + SMOOTH) / (psum + tsum + SMOOTH)
    if not include_background:
        dice = dice[:, 1:]
    dice_loss = 1.0 - dice.mean()
    ce_loss = ce_sum.sum() / count.sum()
    return (dice_loss + ce_loss) / 2


@torch.no_grad()
def class_dice(logits: torch.Tensor, labels: torch.Tensor, grid: Grid | None = None) -> torch.Tensor:
    """Dice of argmax predictions per sample and class, background included: (n, K).

    A class absent from both prediction and label scores 1 (smooth / smooth).
    """
    labels = _labels(labels)
    k = logits.shape[1]
    pred = logits.argmax(dim=1)
    cls = torch.arange(k, device=labels.device).view(1, k, 1, 1, 1)
    p, t = pred[:, None] == cls, labels[:, None] == cls
    dims = (2, 3, 4)
    # float64 keeps voxel counts of large volumes exact.
    sums = _reduce(torch.cat([(p & t).sum(dims), p.sum(dims), t.sum(dims)], dim=1).double(), grid)
    inter, psum, tsum = sums[:, :k], sums[:, k:2 * k], sums[:, 2 * k:]
    return ((2 * inter + SMOOTH) / (psum + tsum + SMOOTH)).float()


def dice_per_sample(logits: torch.Tensor, labels: torch.Tensor, grid: Grid | None = None,
                    include_background: bool = False) -> torch.Tensor:
    """Mean Dice of each sample over the (foreground) classes: shape (n,)."""
    dice = class_dice(logits, labels, grid)
    return (dice if include_background else dice[:, 1:]).mean(dim=1)
