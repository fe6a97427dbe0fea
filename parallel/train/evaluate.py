"""Evaluation: loss and metric over the validation split, reduced over the grid.

The model's loss and per-sample metric are already whole-volume values, replicated over
each spatial group (the family computes them from spatially reduced sums); the sums over
samples are then added over the data group. Ranks whose data group has no sample in a
step (a short last batch) skip the forward: every collective inside the model stays
within one spatial group, whose ranks always hold the same samples.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, ContextManager

import torch
from parallel import comm
from torch import nn

from parallel.grid import Grid
from parallel.train.family import Family


def autocast(precision: str, device: torch.device) -> ContextManager[Any]:
    """The autocast context for ``train.precision`` (a no-op for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("train.precision=fp16 needs a GPU (its grad scaler is CUDA-only); use bf16 on CPUs")
    return torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def evaluate(model: nn.Module, loader: Any, family: Family, grid: Grid, precision: str,
             epoch: int) -> dict[str, float]:
    """Mean loss and mean metric over the validation samples; the same on every rank.

    ``loader`` yields ``(parallel.train.data.Batch, StepStats)``."""
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    sums = torch.zeros(3, dtype=torch.float64, device=grid.device)
    loader.set_epoch(epoch)
    for batch, _ in loader:
        x, y = batch.fields[family.input_field], batch.fields[family.target_field]
        n = x.shape[0]
        if n == 0:
            continue
        with autocast(precision, grid.device):
            out = model(x)
        sums[0] += family.loss(out, y, grid).double() * n
        sums[1] += family.metric(out, y, grid).double().sum()
        sums[2] += n
    if grid.data_size > 1:
        comm.all_reduce_(sums, grid.data_group, caller="evaluate")
    model.train(was_training)
    count = max(sums[2].item(), 1.0)
    return {"val_loss": sums[0].item() / count, f"val_{family.metric_name}": sums[1].item() / count,
            "val_samples": int(sums[2].item()), "eval_seconds": time.perf_counter() - t0}
