"""The loop's evaluation: when it runs, and the loss and metric over the validation split.

``evaluation_due`` is the schedule (``train.eval_every``, ``eval.start_epoch``).
``Evaluator`` runs ``parallel.infer.evaluate_cases`` with the job's ``eval`` section:
``eval.mode=sliding`` (the MLPerf U-Net's Gaussian-weighted sliding window, every window
split across the spatial group) or ``whole`` (one pass over whole samples, batched where
they share one shape). The model's loss and per-sample metric are already whole-volume
values, replicated over each spatial group (the family computes them from spatially
reduced sums); the sums over samples are then added over the data group. Ranks whose
data group has no sample in a step (a short share) skip the forward: every collective
inside the model stays within one spatial group, whose ranks always hold the same samples.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parallel.grid import Grid
from parallel.infer import evaluate_cases
from parallel.job.config import EvalConfig
from parallel.job.family import Family
from parallel.train.checks import window
from parallel.train.precision import autocast, compute_dtype


def evaluation_due(epoch: int, every: int, start_epoch: int = 0) -> bool:
    """Whether to evaluate after (1-based) ``epoch``: the reference evaluates at
    ``start_epoch`` and every ``every`` epochs after it (MLPerf U-Net: 1000, 1020, ...);
    ``start_epoch=0`` evaluates whenever ``epoch`` is a multiple of ``every``; ``every=0`` never."""
    if every <= 0:
        return False
    if start_epoch <= 0:
        return epoch % every == 0
    return epoch >= start_epoch and (epoch - start_epoch) % every == 0


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


class Evaluator:
    """Mean loss and metric over the validation cases, as the ``eval`` section says (sliding
    window or whole samples, averaged over cases or data groups), the same on every rank.

    ``loader``: the validation ``BlockLoader`` (its batches carry the regions read);
    ``crop``: ``data.crop`` (the sliding window's default); ``precision``: ``train.precision``.
    """

    def __init__(self, model: nn.Module, loader: Any, family: Family, grid: Grid, ev: EvalConfig,
                 crop: Any, precision: str) -> None:
        self.model, self.family, self.grid, self.ev, self.precision = model, family, grid, ev, str(precision)
        dtype = compute_dtype(self.precision)
        self.loader = _Cast(loader, dtype) if dtype is not None else loader
        self.window = window(ev, crop)
        self.metric_key = f"val_{family.metric_name}"

    def __call__(self, epoch: int) -> dict[str, float]:
        """The validation figures after ``epoch`` (0-based epochs finished): ``val_loss``, the
        metric (``val_<metric_name>``), ``val_samples``, ``eval_seconds``."""
        fam, ev = self.family, self.ev
        out = evaluate_cases(self.model, self.loader, self.grid, input_field=fam.input_field,
                             target_field=fam.target_field, metric=fam.metric, loss=fam.loss,
                             mode=str(ev.mode), window=self.window,  # type: ignore[arg-type]
                             overlap=ev.overlap, pad_value=ev.pad_value, sigma_scale=ev.sigma_scale,
                             autocast=lambda: autocast(self.precision, self.grid.device), epoch=epoch,
                             average=str(ev.average))  # type: ignore[arg-type]
        return {"val_loss": out["loss"], self.metric_key: out["metric"], "val_samples": out["samples"],
                "eval_seconds": out["seconds"]}
