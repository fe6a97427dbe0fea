"""What every spatial layer shares: its grid, its name, its shape cache and its plans.

Spatial layers are subclasses of the torch layers they replace, built from the serial
layer's own ``__dict__``: parameters, buffers, hooks and ``state_dict`` keys stay those
of the serial layer, only ``forward`` changes.
"""

from __future__ import annotations

from typing import Callable, Literal, TypeVar

import torch
from torch import nn

from parallel.grid import Grid
from parallel.layers.shapes import ShapeTracker
from parallel.partition import DIM_NAMES, SplitError, block_bounds
from parallel.split.halo import ExchangePlan, make_plan

T = TypeVar("T", bound=nn.Module)


class SpatialMixin:
    """Grid, name and caches of a spatial layer (set by ``attach``)."""

    grid: Grid
    shapes: ShapeTracker
    layer_name: str

    def attach(self, grid: Grid, shapes: ShapeTracker, name: str) -> None:
        self.grid, self.shapes, self.layer_name = grid, shapes, name
        self._plan_cache: dict[tuple, object] = {}

    @property
    def where(self) -> str:
        serial = next(c.__name__ for c in type(self).__mro__ if c.__module__.startswith("torch.nn"))
        return f"layer '{self.layer_name}' ({serial})"

    def global_dims(self, x: torch.Tensor) -> tuple[int, int, int]:
        return self.shapes.global_dims(self, x, self.where)  # type: ignore[arg-type]

    def cached(self, key: tuple, build: Callable[[], object]) -> object:
        plan = self._plan_cache.get(key)
        if plan is None:
            plan = self._plan_cache[key] = build()
        return plan

    def split_error(self, axis: int, n_in: int, n_out: int) -> SplitError:
        return SplitError(
            f"{self.where}: output size {n_out} along dim {DIM_NAMES[axis]} (input {n_in}) "
            f"cannot be split {self.grid.spatial[axis]} ways; use fewer blocks along "
            f"{DIM_NAMES[axis]} or a larger volume")

    def window_plan(self, axis: int, n_owned: int, windows: list[tuple[int, int]],
                    mode: Literal["constant", "circular"]) -> ExchangePlan:
        """The exchange plan along ``axis`` for windows over a dim of ``n_owned``."""
        line = self.grid.line_ranks(axis + 2)
        return make_plan(n_owned, line, self.grid.coords[axis], windows, mode)

    def output_bounds(self, axis: int, n_in: int, n_out: int) -> list[tuple[int, int]]:
        parts = self.grid.spatial[axis]
        if n_out < parts:
            raise self.split_error(axis, n_in, n_out)
        return block_bounds(n_out, parts)


def sliding_windows(out_bounds: list[tuple[int, int]], kernel: int, stride: int, dilation: int,
                    pad_left: int) -> list[tuple[int, int]]:
    """The input window each output block of a sliding-window layer reads."""
    span = dilation * (kernel - 1) + 1
    return [(c * stride - pad_left, (e - 1) * stride - pad_left + span) for c, e in out_bounds]


def convert(layer: nn.Module, cls: type[T], grid: Grid, shapes: ShapeTracker, name: str) -> T:
    """A ``cls`` instance sharing ``layer``'s parameters, buffers and settings."""
    new = cls.__new__(cls)
    new.__dict__.update(layer.__dict__)
    new.attach(grid, shapes, name)  # type: ignore[attr-defined]
    return new
