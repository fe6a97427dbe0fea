"""Evaluation over whole cases: loss and metric per case, averaged over the cases.

Each data group takes its share of the cases (``parallel.data.ShardSampler``: a
contiguous share in file order, as the reference deals its evaluation cases); the ranks of
a spatial group hold blocks of the same case. Two modes, one function per case
(``case_logits``, which ``python -m unet3d.predict`` calls too):

- ``sliding`` (the MLPerf metric): the loader's dataset reads each rank's block of the
  case's kept part (``regions=WindowCrop(window, overlap)``) and the logits are the
  Gaussian-weighted sliding-window average (``parallel.infer.sliding``);
- ``whole`` (this project's extension, not the MLPerf metric): one pass of the model over
  each rank's block of the whole sample (a batch of them when they share one shape), which
  needs every case's sides divisible by the network's total stride and memory for the
  case's activations across the group.

The metric of each case is the family's (the U-Net: Dice of argmax per foreground class,
smooth 1e-6, averaged over kidney and tumour). ``average="cases"`` returns its mean over
all cases (the same at every grid); ``"groups"`` the mean of each data group's mean, as the
reference computes it (each of its ranks averages its share of the cases, then
``reduce_tensor`` averages the ranks; a rank of the reference is a data group here). The
two differ only when the data groups hold unequal numbers of cases (42 cases over 8
groups: shares of 6 and 5).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Literal, Sequence

import torch
from torch import nn

from parallel import comm
from parallel.data.crops import REGION_KEY
from parallel.infer.sliding import sliding_window_logits
from parallel.infer.windows import PAD_VALUE, plan_windows

Metric = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]
Forward = Callable[[torch.Tensor], torch.Tensor]


def case_logits(forward: Forward, x: torch.Tensor, grid: Any, *, mode: Literal["sliding", "whole"] = "sliding",
                region: torch.Tensor | None = None, window: Sequence[int] | None = None, overlap: float = 0.5,
                pad_value: float = PAD_VALUE, sigma_scale: float = 0.125) -> torch.Tensor:
    """This rank's block of one case's logits (1, K, d, h, w), evaluation and prediction alike.

    ``x``: this rank's block (1, C, d, h, w) of the region the dataset read; ``region``:
    that region (``REGION_KEY``: start and size), whose size the sliding window covers;
    ``forward``: the spatially parallel model. Collective over the spatial group.
    """
    if mode == "whole":
        return forward(x)
    if mode != "sliding":
        raise ValueError(f"evaluation mode {mode!r}: choose 'sliding' or 'whole'")
    if window is None:
        raise ValueError("sliding-window evaluation needs a window size")
    if region is None:
        raise ValueError("sliding-window evaluation reads each case's kept part: give the dataset "
                         "regions=parallel.infer.WindowCrop(window, overlap)")
    plan = plan_windows([int(v) for v in region[3:]], window, overlap)
    return sliding_window_logits(forward, x, plan, grid, pad_value, sigma_scale)


@torch.no_grad()
def evaluate_cases(model: nn.Module | Forward, loader: Any, grid: Any, *,
                   input_field: str, target_field: str, metric: Metric, loss: Metric | None = None,
                   mode: Literal["sliding", "whole"] = "sliding", window: Sequence[int] | None = None,
                   overlap: float = 0.5, pad_value: float = PAD_VALUE, sigma_scale: float = 0.125,
                   autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
                   epoch: int = 0, average: Literal["cases", "groups"] = "cases") -> dict[str, float]:
    """Mean loss and metric over the cases the loader gives the data groups; the same on
    every rank. Collective over the job (the sums are added over the data group).

    ``loader`` yields ``(batch dict, stats)``; in ``whole`` mode a batch runs in one
    forward. Returns ``{"loss", "metric", "samples", "seconds"}`` (``loss`` is NaN without
    ``loss``).
    """
    if average not in ("cases", "groups"):
        raise ValueError(f"evaluation average {average!r}: choose 'cases' or 'groups'")
    was_training = getattr(model, "training", False)
    if isinstance(model, nn.Module):
        model.eval()
    t0 = time.perf_counter()
    device = grid.device if grid is not None else torch.device("cpu")
    sums = torch.zeros(3, dtype=torch.float64, device=device)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with autocast():
            return model(x)

    loader.set_epoch(epoch)
    for batch, _ in loader:
        x, y = batch[input_field], batch[target_field]
        n = x.shape[0]
        if n == 0:
            continue
        if mode == "whole":  # one forward for the batch (its samples share one shape)
            pieces = [(forward(x), y)]
        else:
            regions = batch.get(REGION_KEY)
            pieces = [(case_logits(forward, x[i:i + 1], grid, mode=mode, window=window, overlap=overlap,
                                   region=regions[i] if regions is not None else None, pad_value=pad_value,
                                   sigma_scale=sigma_scale), y[i:i + 1]) for i in range(n)]
        for logits, yi in pieces:
            if loss is not None:
                sums[0] += loss(logits, yi, grid).double() * yi.shape[0]
            sums[1] += metric(logits, yi, grid).double().sum()
            sums[2] += yi.shape[0]
    if isinstance(model, nn.Module):
        model.train(was_training)
    total = _over_groups(sums, grid, average)
    count = max(total[2].item(), 1.0)
    return {"loss": total[0].item() / count if loss is not None else float("nan"),
            "metric": total[1].item() / count, "samples": int(total[2].item()),
            "seconds": time.perf_counter() - t0}


def _over_groups(sums: torch.Tensor, grid: Any, average: str) -> torch.Tensor:
    """(loss sum, metric sum, count) over the data groups. ``groups``: each group's means
    weigh 1 (a group without cases 0), returned as sums over a count of the groups."""
    if average == "groups":
        n = sums[2].item()
        sums = torch.stack([sums[0] / max(n, 1.0), sums[1] / max(n, 1.0), sums.new_tensor(1.0 if n else 0.0)])
    if grid is not None and grid.data_size > 1:
        comm.all_reduce_(sums, grid.data_group, caller="parallel.infer.evaluate_cases")
    return sums
