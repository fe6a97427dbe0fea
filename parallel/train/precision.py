"""``train.precision``: the autocast a step and an evaluation run under, the dtype weights
and samples take (fp64), and the fp16 loss scaler, deciding from the global gradient norm.

The loss scaler: torch's ``GradScaler`` decides on each rank alone whether a step overflowed (its
``found_inf`` comes from the gradients that rank holds): a sharded Flatten+Linear weight's
gradient differs per rank, so one rank could skip a step the others take, and rescale
alone, and the replicas would part. ``LossScaler`` keeps torch's rules (start at 2^16,
halve on an overflow and skip the step, double after 2000 good steps in a row) but takes
the overflow from ``parallel.train.gradnorm.global_grad_norm``, identical on every rank.
Its ``state_dict`` has torch's keys, so checkpoints of either load in both. It runs on
any device (CPU fp16 autocast included), so the tests cover the GPU's arithmetic.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterable

import torch


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


class LossScaler:
    """Dynamic loss scaling for fp16 with a decision every rank shares.

    The step calls ``scale(loss)`` before each backward, ``unscale_(params)`` after the
    gradient sync, takes the global norm, and after the optimiser step (or its skip)
    ``update(finite)`` with the norm's finiteness. ``get_scale()``: the scale the current
    step's gradients carry until ``unscale_`` (K-FAC reads it for its captured gradients).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval >= 1):
            raise ValueError(f"loss scaler: growth_factor {growth_factor} must be > 1, backoff_factor "
                             f"{backoff_factor} in (0, 1), growth_interval {growth_interval} >= 1")
        self._scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self._growth_tracker = 0
        self.skipped = 0

    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale

    def unscale_(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Divide the gradients by the scale (in place; non-finite values stay non-finite)."""
        inv = 1.0 / self._scale
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inv)

    def update(self, finite: bool) -> None:
        """After a step: halve the scale on an overflow (the step was skipped), double it
        after ``growth_interval`` finite steps in a row. ``finite`` must be the same on
        every rank (the global norm's)."""
        if not finite:
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
            self.skipped += 1
            return
        self._growth_tracker += 1
        if self._growth_tracker >= self.growth_interval:
            self._scale *= self.growth_factor
            self._growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        """torch ``GradScaler``'s keys and meanings."""
        return {"scale": self._scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load this class's or torch ``GradScaler``'s ``state_dict``."""
        if "scale" not in state:
            raise KeyError(f"loss scaler state without 'scale' (keys: {sorted(state)})")
        self._scale = float(state["scale"])
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        self._growth_tracker = int(state.get("_growth_tracker", 0))
