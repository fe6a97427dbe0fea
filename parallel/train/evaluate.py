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
from parallel.job.config import JobConfig
from parallel.job.family import Family


def autocast(precision: str, device: torch.device) -> ContextManager[Any]:
    """The autocast context for ``train.precision`` (a no-op for fp32 and fp64)."""
    if str(precision) in ("fp32", "fp64"):
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def compute_dtype(precision: str) -> torch.dtype | None:
    """The dtype weights and samples are cast to for ``train.precision`` (fp64: float64);
    None: they stay float32 (autocast rounds inside the forward)."""
    return torch.float64 if str(precision) == "fp64" else None


class _Cast:
    """A loader whose floating fields come in ``dtype`` (``train.precision=fp64``)."""

    def __init__(self, loader: Any, dtype: torch.dtype) -> None:
        self.loader, self.dtype = loader, dtype

    def set_epoch(self, epoch: int, *args: Any) -> None:
        self.loader.set_epoch(epoch, *args)

    def __iter__(self) -> Any:
        for batch, stats in self.loader:
            yield {k: v.to(self.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                   for k, v in batch.items()}, stats


def evaluate(model: nn.Module, loader: Any, family: Family, grid: Grid, cfg: JobConfig,
             epoch: int) -> dict[str, float]:
    """Mean loss and metric over the validation cases, as ``cfg.eval`` says (sliding window
    or whole samples, averaged over cases or data groups); the same on every rank.

    ``loader``: the validation ``BlockLoader`` (its batches carry the regions read)."""
    ev = cfg.eval
    window = eval_window(cfg)
    dtype = compute_dtype(str(cfg.train.precision))
    if dtype is not None:
        loader = _Cast(loader, dtype)
    out = evaluate_cases(model, loader, grid, input_field=family.input_field, target_field=family.target_field,
                         metric=family.metric, loss=family.loss, mode=str(ev.mode),  # type: ignore[arg-type]
                         window=window,
                         overlap=ev.overlap, pad_value=ev.pad_value, sigma_scale=ev.sigma_scale,
                         autocast=lambda: autocast(str(cfg.train.precision), grid.device), epoch=epoch,
                         average=str(ev.average))  # type: ignore[arg-type]
    return {"val_loss": out["loss"], f"val_{family.metric_name}": out["metric"], "val_samples": out["samples"],
            "eval_seconds": out["seconds"]}
