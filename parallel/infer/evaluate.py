"""Evaluation over whole cases: loss and metric per case, averaged over the cases.

Each data group takes its share of the cases (the loader's sampler: one case per group
and step, ``GlobalShuffleSampler(n, grid, global_batch=grid.data_size, shuffle=False,
drop_last=False)``); the ranks of a spatial group hold blocks of the same case. Two modes:

- ``sliding`` (the MLPerf metric): the loader's dataset reads each rank's block of the
  case's kept part (``regions=WindowCrop(window, overlap)``) and the logits are the
  Gaussian-weighted sliding-window average (``parallel.infer.sliding``);
- ``whole`` (this project's extension, not the MLPerf metric): one pass of the model over
  each rank's block of the whole case, which needs every case's sides divisible by the
  network's total stride and memory for the case's activations across the group.

The metric of each case is the family's (the U-Net: Dice of argmax per foreground class,
smooth 1e-6, averaged over kidney and tumour); the result is its mean over all cases. The
reference averages per-rank means (``reduce_tensor`` of each rank's mean), which differs
when the ranks hold unequal numbers of cases; here every case weighs the same.
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


def evaluation_due(epoch: int, every: int, start_epoch: int = 0) -> bool:
    """Whether to evaluate after (1-based) ``epoch``: the reference evaluates at
    ``start_epoch`` and every ``every`` epochs after it (MLPerf U-Net: 1000, 1020, ...);
    ``start_epoch=0`` evaluates whenever ``epoch`` is a multiple of ``every``; ``every=0`` never."""
    if every <= 0:
        return False
    if start_epoch <= 0:
        return epoch % every == 0
    return epoch >= start_epoch and (epoch - start_epoch) % every == 0


@torch.no_grad()
def evaluate_cases(model: nn.Module | Callable[[torch.Tensor], torch.Tensor], loader: Any, grid: Any, *,
                   input_field: str, target_field: str, metric: Metric, loss: Metric | None = None,
                   mode: Literal["sliding", "whole"] = "sliding", window: Sequence[int] | None = None,
                   overlap: float = 0.5, pad_value: float = PAD_VALUE, sigma_scale: float = 0.125,
                   autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
                   epoch: int = 0) -> dict[str, float]:
    """Mean loss and metric over the cases the loader gives the data groups; the same on
    every rank. Collective over the job (the sums are added over the data group).

    Returns ``{"loss", "metric", "samples", "seconds"}`` (``loss`` is NaN without ``loss``).
    """
    if mode not in ("sliding", "whole"):
        raise ValueError(f"evaluation mode {mode!r}: choose 'sliding' or 'whole'")
    if mode == "sliding" and window is None:
        raise ValueError("sliding-window evaluation needs a window size")
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
        for i in range(x.shape[0]):
            xi, yi = x[i:i + 1], y[i:i + 1]
            if mode == "sliding":
                if REGION_KEY not in batch:
                    raise ValueError("sliding-window evaluation reads each case's kept part: give the dataset "
                                     "regions=parallel.infer.WindowCrop(window, overlap)")
                kept = [int(v) for v in batch[REGION_KEY][i, 3:]]
                plan = plan_windows(kept, window, overlap)  # type: ignore[arg-type]
                logits = sliding_window_logits(forward, xi, plan, grid, pad_value, sigma_scale)
            else:
                logits = forward(xi)
            if loss is not None:
                sums[0] += loss(logits, yi, grid).double()
            sums[1] += metric(logits, yi, grid).double().sum()
            sums[2] += 1
    if grid is not None and grid.data_size > 1:
        comm.all_reduce_(sums, grid.data_group, caller="parallel.infer.evaluate_cases")
    if isinstance(model, nn.Module):
        model.train(was_training)
    count = max(sums[2].item(), 1.0)
    return {"loss": sums[0].item() / count if loss is not None else float("nan"),
            "metric": sums[1].item() / count, "samples": int(sums[2].item()),
            "seconds": time.perf_counter() - t0}
