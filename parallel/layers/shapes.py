"""Global sizes of the blocks a spatial layer receives.

A rank sees only its block, and a block size alone does not tell the global size (19
split 3 ways gives 7, 6, 6; 18 gives 6, 6, 6). The ranks of a spatial group therefore
exchange their block sizes once per layer call and per global input shape of the whole
model, and cache the answer; the model input's global shape is exchanged per forward,
or declared by the caller (``ShapeTracker.fixed``: the training loop's steps). The cache key (the model's global input shape and the
layer's call count in this forward) is the same on every rank, so all ranks hit or miss
the cache together and nobody waits on a collective that others skip.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from parallel import comm
from parallel.grid import Grid
from parallel.partition import DIM_NAMES, SplitError, block_bounds


def infer_global_dims(x: torch.Tensor, grid: Grid, where: str) -> tuple[int, int, int]:
    """The global (D, H, W) of the distributed tensor whose block on this rank is ``x``.

    Collective over the spatial group. Raises if the blocks are not the canonical split
    of that size (a tensor that was not scattered or produced by spatial layers).
    """
    if x.dim() != 5:
        raise ValueError(f"{where}: expected a 5-D block (N, C, D, H, W), got shape {tuple(x.shape)}")
    local = tuple(int(s) for s in x.shape[2:])
    if grid.spatial_size == 1:
        return local  # type: ignore[return-value]
    # On the group's device (NCCL takes only tensors on the rank's GPU); one copy back.
    mine = torch.tensor(local, dtype=torch.int64).to(comm.group_device(grid.spatial_group))
    sizes = torch.stack(comm.all_gather(mine, grid.spatial_group)).tolist()
    by_coords = {grid.spatial_coords(r): tuple(s) for r, s in enumerate(sizes)}
    dims = []
    for axis in range(3):
        line = []
        for i in range(grid.spatial[axis]):
            coords = [0, 0, 0]
            coords[axis] = i
            line.append(by_coords[tuple(coords)][axis])
        n = sum(line)
        try:
            expected = [b - a for a, b in block_bounds(n, grid.spatial[axis])]
        except SplitError as err:
            raise SplitError(f"{where}: dim {DIM_NAMES[axis]} of size {n} cannot be split "
                             f"{grid.spatial[axis]} ways") from err
        if line != expected:
            raise SplitError(
                f"{where}: blocks along dim {DIM_NAMES[axis]} have sizes {line}, but a dim of "
                f"{n} split {grid.spatial[axis]} ways gives {expected}; was the input made by "
                f"parallel.scatter or a reader using the same grid?")
        dims.append(n)
    return tuple(dims)  # type: ignore[return-value]


def block_dims(volume: Sequence[int], grid: Grid) -> tuple[int, int, int]:
    """This rank's block size of a global (D, H, W) ``volume``."""
    return tuple(b - a for a, b in grid.block_range(tuple(int(v) for v in volume)))  # type: ignore[return-value]


# Volumes declared by ``fixed_volume`` for the grids whose steps run inside it (keyed by the
# grid object's id; set and restored by the context manager, like torch's autocast state).
_DECLARED: dict[int, tuple[tuple[int, ...], tuple[int, int, int]]] = {}


@contextlib.contextmanager
def fixed_volume(grid: Grid, volume: Sequence[int]) -> Iterator[None]:
    """Inside: every input block on ``grid`` (a model input, a batch to augment) is a block
    of the global (D, H, W) ``volume``, so ``input_volume`` needs no all-gather. The
    training loop declares its batches' volume (a crop, or cases of one shape)."""
    key, outer = id(grid), _DECLARED.get(id(grid))
    dims = tuple(int(v) for v in volume)
    _DECLARED[key] = (dims, block_dims(dims, grid))
    try:
        yield
    finally:
        if outer is None:
            _DECLARED.pop(key, None)
        else:
            _DECLARED[key] = outer


def input_volume(x: torch.Tensor, grid: Grid, where: str) -> tuple[int, int, int]:
    """The global (D, H, W) of the input whose block on this rank is ``x``: the declared
    volume (``fixed_volume``; checked against this rank's block, no communication), else
    ``infer_global_dims`` (collective over the spatial group)."""
    declared = _DECLARED.get(id(grid))
    if declared is None or grid.spatial_size == 1:
        return infer_global_dims(x, grid, where)
    dims, block = declared
    local = tuple(int(s) for s in x.shape[2:])
    if x.dim() != 5 or local != block:
        raise SplitError(f"{where}: block of shape {tuple(x.shape)} where the declared volume {list(dims)} "
                         f"split {list(grid.spatial)} ways gives this rank {list(block)}")
    return dims  # type: ignore[return-value]


class ShapeTracker:
    """Caches each spatial layer's global input size, per model input shape and call.

    The model input's own global size is inferred (one all-gather) per forward, unless
    the caller declares it (``fixed``): the training loop knows the volume of every
    training batch, so its steps run with no collective for shapes at all.
    """

    def __init__(self, grid: Grid, max_entries: int = 4096) -> None:
        self.grid = grid
        self.max_entries = max_entries
        self._key: tuple[int, ...] | None = None
        self._calls: dict[int, int] = {}
        self._cache: dict[tuple, tuple[int, int, int]] = {}

    def fixed(self, volume: Sequence[int]) -> contextlib.AbstractContextManager:
        """Inside: every model input has the global (D, H, W) ``volume`` (``fixed_volume``)."""
        return fixed_volume(self.grid, volume)

    def input_dims(self, x: torch.Tensor, where: str) -> tuple[int, int, int]:
        """The global (D, H, W) of the model input whose block is ``x`` (``input_volume``)."""
        return input_volume(x, self.grid, where)

    @contextlib.contextmanager
    def forward(self, key: tuple[int, ...] | None) -> Iterator[None]:
        """Scope of one model forward whose input has global shape ``key``."""
        outer = (self._key, self._calls)
        self._key, self._calls = key, {}
        try:
            yield
        finally:
            self._key, self._calls = outer

    def state(self) -> tuple:
        """Where the current forward stands (for replaying a block under recomputation)."""
        return self._key, dict(self._calls)

    @contextlib.contextmanager
    def replay(self, state: tuple) -> Iterator[None]:
        """Run layers again as they ran from ``state`` on: the same cache keys, no collectives."""
        outer = (self._key, self._calls)
        self._key, self._calls = state[0], dict(state[1])
        try:
            yield
        finally:
            self._key, self._calls = outer

    def global_dims(self, layer: torch.nn.Module, x: torch.Tensor, where: str) -> tuple[int, int, int]:
        if self._key is None or self.grid.spatial_size == 1:
            return infer_global_dims(x, self.grid, where)
        call = self._calls.get(id(layer), 0)
        self._calls[id(layer)] = call + 1
        key = (self._key, id(layer), call)
        dims = self._cache.get(key)
        if dims is None:
            if len(self._cache) >= self.max_entries:
                self._cache.clear()
            dims = self._cache[key] = infer_global_dims(x, self.grid, where)
        return dims
