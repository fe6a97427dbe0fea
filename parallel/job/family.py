"""What a model family hands the framework, and the registry that finds families by name.

A family supplies the network, the dataset fields, the loss and metric, its job defaults
(its ``JobConfig`` subclass) and a few facts the tools need (small-model overrides for
benchmarks, a synthetic sample maker); the framework owns everything else and never
names a model.

Families are found by name (``get("mymodel")``, ``python -m parallel.plan --model
mymodel``): one registered in this process (``register``), else the entry for that name
in ``configs/families.yaml`` (``name: module:attr``), else a ``module:attr`` given in
place of the name. Bringing a third model is one line in that table (or
``--model mypkg.family:FAMILY``); see ``docs/training.md``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import numpy as np
import torch
from torch import nn

from parallel.data.format import SampleSpec
from parallel.grid import Grid

Sample = dict[str, torch.Tensor]

CONFIG_ROOT = Path(__file__).resolve().parents[2] / "configs"
TABLE = CONFIG_ROOT / "families.yaml"


@dataclass(frozen=True)
class Family:
    """A model family: the parts of a training job that are particular to one model."""

    name: str
    """Short name, also the default MLPerf benchmark name and the ``configs/<name>/`` folder."""
    config_class: type
    """The family's ``JobConfig`` subclass (its ``model`` section and defaults)."""
    build_model: Callable[[Any, tuple[int, int, int]], nn.Module]
    """(model config, global sample volume (D, H, W)) -> the plain serial network. A model
    section with ``_target_`` builds that network instead, in every family."""
    spec: SampleSpec
    """The fields of the family's sample files (what ``prepare`` writes and training reads)."""
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
    prepare: str = ""
    """The command that writes the family's data (``python -m <package>.prepare``), quoted
    in errors about missing or bad sample files."""
    bench_overrides: tuple[str, ...] = ()
    """``model.*`` overrides of the model the benchmarks and the calibration time by default."""
    tiny_overrides: tuple[str, ...] = ()
    """``model.*`` overrides of the smallest model of the family (warms a rank up before a
    memory measurement)."""
    synthetic: Optional[Callable[[int, int, int, int], dict[str, np.ndarray]]] = None
    """(seed, split, index, size) -> one synthetic sample as field arrays (no sample axis),
    for the I/O benchmarks."""
    decayed: Optional[Callable[[nn.Module], list[str]]] = None
    """(serial model) -> names of the only parameters weight decay applies to (the
    reference's choice, e.g. CosmoFlow's hidden dense weights); None: all
    (``optim.decay_all=true`` overrides it)."""
    crop_boxes: Optional[str] = None
    """Scalar field of the sample files holding the foreground boxes that training crops
    (``data.crop``, ``parallel.data.crops.BalancedCrop``) choose from; None: crops are
    placed uniformly (``data.oversampling`` must then be 0)."""

    def __post_init__(self) -> None:
        # Every family also builds a network named by ``_target_`` (parallel.job.usermodel),
        # so that the loop, the checks, the planner and the predict commands need not ask.
        if not getattr(self.build_model, "takes_user_models", False):
            object.__setattr__(self, "build_model", _or_user_model(self.build_model))

    def reached(self, value: float, target: float) -> bool:
        """Whether a metric value meets ``target``."""
        return value <= target if self.goal == "min" else value >= target

    def trained_spec(self, crops: bool = False) -> SampleSpec:
        """The sample spec limited to the two fields training reads, and with ``crops``
        the foreground boxes the crops choose from (then with the spec's own checks,
        which relate the boxes to the label)."""
        boxes = (self.crop_boxes,) if crops and self.crop_boxes else ()
        wanted = (self.input_field, self.target_field) + boxes
        checks = self.spec.checks if len(wanted) > 2 else ()
        return SampleSpec(self.spec.name, tuple(f for f in self.spec.fields if f.name in wanted), self.spec.attrs,
                          checks)

    def prepare_hint(self, out: str) -> str:
        """How to write a data set to ``out`` (for error messages)."""
        command = self.prepare or "the family's prepare command"
        return f"`{command} synthetic --out {out}`"


def _or_user_model(build: Callable[[Any, tuple[int, int, int]], nn.Module]
                   ) -> Callable[[Any, tuple[int, int, int]], nn.Module]:
    """``build``, except for a model section with ``_target_``: that network instead."""
    from parallel.job.usermodel import build_user_model, is_user_model

    def build_model(cfg: Any, volume: tuple[int, int, int]) -> nn.Module:
        return build_user_model(cfg, volume) if is_user_model(cfg) else build(cfg, volume)

    build_model.takes_user_models = True  # type: ignore[attr-defined]
    build_model.__doc__ = build.__doc__
    return build_model


_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Make ``family`` known by its name in this process; returns it (for ``FAMILY = register(...)``)."""
    _REGISTRY[family.name] = family
    return family


def table() -> dict[str, str]:
    """``configs/families.yaml``: family name -> ``module:attr``, in the file's order."""
    if not TABLE.is_file():
        return {}
    from omegaconf import OmegaConf

    return {str(k): str(v) for k, v in OmegaConf.to_container(OmegaConf.load(TABLE)).items()}  # type: ignore[union-attr]


def names() -> list[str]:
    """The families of the table, then any others registered in this process."""
    listed = list(table())
    return listed + [n for n in _REGISTRY if n not in listed]


def get(name: str) -> Family:
    """The family called ``name`` (registered, listed in the table, or ``module:attr``)."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    target = name if ":" in name else table().get(name)
    if target is None:
        raise ValueError(f"unknown model family {name!r}: known {', '.join(names()) or 'none'} "
                         f"({TABLE}), or name one as module:attr")
    module, _, attr = target.partition(":")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"model family {name!r}: cannot load {target} ({err})") from err
    if not isinstance(found, Family):
        raise ValueError(f"model family {name!r}: {target} is a {type(found).__name__}, not a Family")
    return register(found) if found.name not in _REGISTRY else _REGISTRY[found.name]


def model_config(family: Family, overrides: tuple[str, ...] | list[str] = ()) -> Any:
    """The family's default model config with ``model.*`` dotlist overrides applied (with
    ``model._target_``: the overrides alone, the keyword arguments of that network)."""
    from omegaconf import OmegaConf

    over = OmegaConf.from_dotlist([o[len("model."):] for o in overrides if o.startswith("model.")])
    from parallel.job.usermodel import is_user_model

    if is_user_model(over):  # another network: its keyword arguments, not the family's section
        return OmegaConf.to_container(over)
    node = OmegaConf.structured(family.config_class).model
    return OmegaConf.to_object(OmegaConf.merge(node, over))
