"""Fault injection for tests: one bit of one tensor flipped on one rank at a chosen step.

Silent data corruption cannot be waited for in a test, so a test makes it: the
environment variable ``SPATIALCNN_FLIP_BIT`` (unset in real runs; nothing here runs
without it) names the fault as comma-separated ``key=value`` pairs::

    SPATIALCNN_FLIP_BIT="step=3,rank=1,tensor=features.0.bias,bit=30,index=0,at=weight"

- ``step``: the (1-based) step; ``rank``: the rank whose copy is hit;
- ``tensor``: a parameter's name in the serial model (``model.named_parameters()``);
- ``bit`` (default 30: the highest exponent bit of a float32) and ``index`` (default 0:
  the element of the flattened tensor, on that rank);
- ``at``: ``weight`` (default: after the step's update, as a flip in memory would leave
  the weight; the replica check, ``parallel.train.replicas``, sees it), ``grad`` (the
  gradient after its sync, before the update, once: a transient fault in the step's
  arithmetic; the replayed step, ``parallel.train.replay``, computes it afresh) or
  ``state:<key>`` (the optimiser's state of the parameter, e.g. ``state:momentum_buffer``).

Each fault fires once, and is logged (``WARNING fault injected: ...``) on the rank it hits.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parallel.grid import Grid
from parallel.job.errors import InputError
from parallel.train.observe.events import Observer

log = logging.getLogger("parallel.train")

ENV = "SPATIALCNN_FLIP_BIT"
_INTS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class FlipSpec:
    """One bit flip: see the module docstring."""

    step: int
    rank: int
    tensor: str
    bit: int = 30
    index: int = 0
    at: str = "weight"


def parse(text: str) -> FlipSpec:
    """``SPATIALCNN_FLIP_BIT``'s value as a ``FlipSpec``; ``InputError`` naming the variable."""
    fields: dict[str, Any] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, value = part.partition("=")
        if not sep or key not in FlipSpec.__dataclass_fields__:
            raise InputError(f"{ENV}={text!r}: '{part}' is not one of step=, rank=, tensor=, bit=, index=, at=")
        fields[key] = value if key in ("tensor", "at") else _int(text, key, value)
    missing = [k for k in ("step", "rank", "tensor") if k not in fields]
    if missing:
        raise InputError(f"{ENV}={text!r}: missing {', '.join(missing)}")
    spec = FlipSpec(**fields)
    if spec.at not in ("weight", "grad") and not spec.at.startswith("state:"):
        raise InputError(f"{ENV}={text!r}: at={spec.at}: want weight, grad or state:<key>")
    return spec


def _int(text: str, key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise InputError(f"{ENV}={text!r}: {key}={value}: want an integer") from None


def flip_bit_(t: torch.Tensor, bit: int, index: int = 0) -> tuple[float, float]:
    """Flip bit ``bit`` of element ``index`` of ``t`` (flattened) in place; the element's
    value before and after."""
    d = t.detach()
    # the tensor's memory in order (a channels-last weight is dense but not contiguous)
    flat = d.view(-1) if d.is_contiguous() else d.as_strided((d.numel(),), (1,), d.storage_offset())
    nbits = 8 * flat.element_size()
    if not 0 <= bit < nbits or not 0 <= index < flat.numel():
        raise InputError(f"{ENV}: bit {bit} of element {index}: the tensor has {flat.numel()} elements of "
                         f"{nbits} bits")
    before = float(flat[index])
    words = flat.view(_INTS[flat.element_size()])
    mask = 1 << bit
    if mask >= 1 << (nbits - 1):  # the sign bit, as the signed word type holds it
        mask -= 1 << nbits
    words[index:index + 1].bitwise_xor_(torch.tensor(mask, dtype=words.dtype, device=words.device))
    return before, float(flat[index])


class BitFlip(Observer):
    """The fault of ``spec`` on this rank: ``step_end`` flips a weight or optimiser state
    after the update, ``after_sync()`` a gradient before it (``TrainStep``'s hook)."""

    def __init__(self, spec: FlipSpec, grid: Grid, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        names = dict(model.named_parameters())
        if spec.tensor not in names:
            raise InputError(f"{ENV}: tensor={spec.tensor}: the model has no such parameter (it has "
                             f"{', '.join(list(names)[:8])}{', ...' if len(names) > 8 else ''})")
        if not 0 <= spec.rank < grid.world_size:
            raise InputError(f"{ENV}: rank={spec.rank}: the job has {grid.world_size} ranks")
        self.spec, self.grid, self.optimizer = spec, grid, optimizer
        self.param = names[spec.tensor]
        self.fired = False

    def _hit(self, step: int, at: str) -> bool:
        s = self.spec
        return not self.fired and step == s.step and self.grid.rank == s.rank and \
            (s.at == at or (at == "state" and s.at.startswith("state:")))

    def _flip(self, t: torch.Tensor | None, what: str) -> None:
        if t is None:
            raise InputError(f"{ENV}: step {self.spec.step}: '{self.spec.tensor}' has no {what} to flip")
        before, after = flip_bit_(t, self.spec.bit, self.spec.index)
        self.fired = True
        log.warning("fault injected (%s): rank %d, step %d, %s of '%s' element %d bit %d: %r -> %r", ENV,
                    self.grid.rank, self.spec.step, what, self.spec.tensor, self.spec.index, self.spec.bit,
                    before, after)

    def after_sync(self, step: int) -> None:
        """Before step ``step``'s update (its gradients synchronised): ``at=grad``."""
        if self._hit(step, "grad"):
            self._flip(self.param.grad, "gradient")

    def step_end(self, progress: Any, loss: Any, stats: Any) -> None:
        if self._hit(progress.step, "weight"):
            self._flip(self.param, "weight")
        elif self._hit(progress.step, "state"):
            key = self.spec.at.split(":", 1)[1]
            self._flip(self.optimizer.state.get(self.param, {}).get(key), f"optimiser {key}")


def from_env(grid: Grid, model: nn.Module, optimizer: torch.optim.Optimizer) -> BitFlip | None:
    """The fault ``SPATIALCNN_FLIP_BIT`` asks for, or None (always, in real runs)."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    flip = BitFlip(parse(text), grid, model, optimizer)
    log.warning("%s is set: rank %d will flip bit %d of '%s' at step %d (a test of fault handling)", ENV,
                flip.spec.rank, flip.spec.bit, flip.spec.tensor, flip.spec.step)
    return flip
