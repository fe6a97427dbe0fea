"""Evaluation: loss and metric over the validation split, reduced over the grid.

The loop's evaluation is ``parallel.infer.evaluate_cases`` with the job's ``eval`` section:
``eval.mode=sliding`` (the MLPerf U-Net's Gaussian-weighted sliding window, every window
split across the spatial group) or ``whole`` (one pass over whole samples, batched where
they share one shape). The model's loss and per-sample metric are already whole-volume
values, replicated over each spatial group (the family computes them from spatially
reduced sums); the sums over samples are then added over the data group. Ranks whose
data group has no sample in a step (a short share) skip the forward: every collective
inside the model stays within one spatial group, whose ranks always hold the same samples.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch
from torch import nn

from parallel.grid import Grid
from parallel.infer import evaluate_cases
from parallel.train.checks import window as eval_window
from parallel.train.config import JobConfig
from parallel.train.family import Family


def autocast(precision: str, device: torch.device) -> ContextManager[Any]:
    """The autocast context for ``train.precision`` (a no-op for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("train.precision=fp16 needs a GPU (its grad scaler is CUDA-only); use bf16 on CPUs")
    return torch.autocast(device_type=device.type, dtype=dtype)


def evaluate(model: nn.Module, loader: Any, family: Family, grid: Grid, cfg: JobConfig,
             epoch: int) -> dict[str, float]:
    """Mean loss and metric over the validation cases, as ``cfg.eval`` says (sliding window
    or whole samples, averaged over cases or data groups); the same on every rank.

    ``loader``: the validation ``BlockLoader`` (its batches carry the regions read)."""
    ev = cfg.eval
    window = eval_window(cfg)
    out = evaluate_cases(model, loader, grid, input_field=family.input_field, target_field=family.target_field,
                         metric=family.metric, loss=family.loss, mode=str(ev.mode),  # type: ignore[arg-type]
                         window=window,
                         overlap=ev.overlap, pad_value=ev.pad_value, sigma_scale=ev.sigma_scale,
                         autocast=lambda: autocast(str(cfg.train.precision), grid.device), epoch=epoch,
                         average=str(ev.average))  # type: ignore[arg-type]
    return {"val_loss": out["loss"], f"val_{family.metric_name}": out["metric"], "val_samples": out["samples"],
            "eval_seconds": out["seconds"]}
