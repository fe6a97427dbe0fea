"""The training state: what a checkpoint holds and a resume restores.

``TrainState`` is one object with ``state_dict``/``load_state_dict`` (the checkpoint's
payload; ``parallel.train.persist.checkpoint`` adds every rank's RNG streams): the serial model's
weights, the optimiser, the fp16 grad scaler, the ``Progress`` of the run and what the
checkpoint was written for (``meta``). Each progress field names its checkpoint key once,
in its declaration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallel.data.loader import StepStats
from parallel.grid import Grid
from parallel.job import checkpoint


@dataclass
class IOCounters:
    """This rank's reading over the run (summed ``StepStats``)."""

    bytes_read: float = 0.0
    """Stored bytes read from the sample files."""
    wait_seconds: float = 0.0
    """Seconds the steps waited for their batches."""
    samples: float = 0.0
    """Sample blocks read."""

    def add(self, stats: StepStats) -> None:
        self.bytes_read += float(stats.bytes_read)
        self.wait_seconds += float(stats.wait_seconds)
        self.samples += float(stats.samples)

    def state_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, value: Any) -> "IOCounters":
        """From ``state_dict``'s dict (or a checkpoint's older float64 tensor of the three)."""
        if isinstance(value, torch.Tensor):
            return cls(*(float(v) for v in value.double().cpu().tolist()))
        return cls(**{f.name: float(value.get(f.name, 0.0)) for f in dataclasses.fields(cls)})


def _saved(key: str, default: Any = 0, load: Any = int, factory: Any = None) -> Any:
    """A progress field saved under checkpoint ``key`` and read back with ``load``."""
    meta = {"key": key, "load": load}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


@dataclass
class Progress:
    """How far the run has come; each field's checkpoint key is in its metadata."""

    step: int = _saved("step")
    """Optimiser steps done."""
    epoch: int = _saved("epoch")
    """Epochs finished."""
    samples: int = _saved("samples")
    """Samples trained on (global)."""
    best: float | None = _saved("best_metric", None, load=None)
    """Best validation metric so far."""
    reached_s: float | None = _saved("reached_seconds", None, load=None)
    """Run seconds at which the target was first reached."""
    run_s: float = _saved("run_seconds", 0.0, load=float)
    """Run seconds when the state was saved (a resumed run continues the clock from here)."""
    io: IOCounters = _saved("io", load=IOCounters.from_state, factory=IOCounters)
    """This rank's reading (rank 0's in a checkpoint)."""
    skipped_samples: int = _saved("skipped_samples")
    """Samples left out for a non-finite input (this data group)."""
    skipped_steps: int = _saved("skipped_steps")
    """Updates dropped for non-finite gradients."""

    def state_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.metadata["key"]] = value.state_dict() if isinstance(value, IOCounters) else value
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from a checkpoint; fields older checkpoints lack keep their defaults."""
        for f in dataclasses.fields(self):
            key = f.metadata["key"]
            if key not in state:
                continue
            load = f.metadata["load"]
            setattr(self, f.name, load(state[key]) if load is not None else state[key])


class TrainState:
    """What a checkpoint holds (see the module docstring).

    Args:
        model: the serial model (or its parallel form: the same ``state_dict`` keys).
        optimizer, scaler: the optimiser and the fp16 grad scaler (None without fp16).
        steps_per_epoch: to record the sampler's position.
        meta: what the checkpoint is written for (family, volume, model config): a resume
            refuses a checkpoint whose ``meta`` differs, naming the fields.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: Any, steps_per_epoch: int, meta: dict[str, Any]) -> None:
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.steps_per_epoch = steps_per_epoch
        self.meta = meta
        self.progress = Progress()

    def _components(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "scaler": self.scaler}

    def state_dict(self, grid: Grid) -> dict[str, Any]:
        """The checkpoint payload (plain tensors and values: loads with ``weights_only``)."""
        from parallel.layers.linear import gather_optimizer_state

        p = self.progress
        # Sharded Linear weights (parallel.layers.linear) come back whole: collectives, as are
        # the model's hooks, so every rank calls this.
        out: dict[str, Any] = {k: gather_optimizer_state(c, self.model) if k == "optimizer" else
                               c.state_dict() if c is not None else {} for k, c in self._components().items()}
        out.update(p.state_dict())
        out["sampler"] = {"epoch": p.epoch, "step": p.step - p.epoch * self.steps_per_epoch}
        out["meta"] = {**self.meta, "spatial": list(grid.spatial), "world_size": grid.world_size}
        return out

    def load_state_dict(self, ckpt: dict[str, Any], path: str | Path) -> None:
        """Restore from checkpoint ``ckpt`` (read from ``path``); ``CheckpointError`` when it
        was written for another model or does not fit this one."""
        from parallel.layers.linear import cut_optimizer_state

        checkpoint.check_matches(ckpt, self.meta, path)
        try:
            for key, component in self._components().items():
                if component is not None and (key != "scaler" or ckpt.get(key)):
                    value = ckpt[key]
                    if key == "optimizer":  # whole state of sharded weights: this rank's columns
                        value = cut_optimizer_state(value, self.optimizer, self.model)
                    component.load_state_dict(value)
        except (RuntimeError, KeyError, ValueError) as err:
            raise checkpoint.CheckpointError(f"checkpoint {path} does not fit this model: {err}") from err
        self.progress.load_state_dict(ckpt)


def plain_config(cfg: Any) -> Any:
    """A config dataclass as plain dicts, lists and scalars (loadable with weights_only)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: plain_config(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, Enum):
        return str(cfg.value)
    if isinstance(cfg, (list, tuple)):
        return [plain_config(v) for v in cfg]
    if isinstance(cfg, dict):
        return {str(k): plain_config(v) for k, v in cfg.items()}
    return cfg
