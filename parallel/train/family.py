"""What a model family hands the shared training loop.

A family (``cosmoflow.family.FAMILY``, ``unet3d.family.FAMILY``) supplies the network,
the dataset fields, the loss and metric, and its job defaults (its ``JobConfig``
subclass); the loop owns everything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

import torch
from torch import nn

from parallel.grid import Grid

Sample = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Family:
    """A model family: the parts of a training job that are particular to one model."""

    name: str
    """Short name (``cosmoflow``, ``unet3d``), also the default MLPerf benchmark name."""
    config_class: type
    """The family's ``JobConfig`` subclass (its ``model`` section and defaults)."""
    build_model: Callable[[Any, tuple[int, int, int]], nn.Module]
    """(model config, global sample volume (D, H, W)) -> the plain serial network."""
    input_field: str
    """Dataset field fed to the network."""
    target_field: str
    """Dataset field the loss compares with."""
    loss: Callable[[torch.Tensor, torch.Tensor, Grid], torch.Tensor]
    """(output, target, grid) -> the loss of the local batch, replicated over the spatial group."""
    metric: Callable[[torch.Tensor, torch.Tensor, Grid], torch.Tensor]
    """(output, target, grid) -> the metric of each local sample (n,), replicated over the spatial group."""
    metric_name: str
    """Name of the validation metric in logs (``mae``, ``mean_dice``)."""
    goal: Literal["min", "max"]
    """Whether the metric reaches its target from above (min: errors) or below (max: scores)."""
    target: float
    """The MLPerf quality target on the validation metric."""
    mlperf_eval_key: str = "eval_error"
    """MLPerf key for the validation metric (HPC: eval_error; Training: eval_accuracy)."""
    transform: Optional[Callable[[Sample], Sample]] = None
    """Runs on each sample's block in the reader's workers (picklable, module-level)."""
    transform_for: Optional[Callable[[dict[str, Any]], Callable[[Sample], Sample]]] = None
    """If set, picks the transform from the sample files' attributes (overrides ``transform``)."""
    augment: Optional[Callable[[Sample, torch.Generator, Grid, Any], Sample]] = None
    """(local batch, generator seeded per step alike on every rank, grid, job config) -> the
    augmented local batch; collective calls allowed (every rank calls it every step)."""

    def reached(self, value: float, target: float) -> bool:
        """Whether a metric value meets ``target``."""
        return value <= target if self.goal == "min" else value >= target
