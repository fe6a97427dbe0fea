"""The process grid: world = data axis x spatial axes (D, H, W).

Ranks are laid out spatial-fastest: ``rank = data_rank * spatial_size + spatial_rank``
and ``spatial_rank = (cd * sh + ch) * sw + cw``. The ranks of one spatial group are
therefore consecutive, which keeps halo traffic inside a node when a launcher places
consecutive ranks together (torchrun, mpirun and srun all do by default).

A ``Grid`` is built once (``parallel.init`` or ``Grid.from_world``) and passed
explicitly to everything that needs it: layers, the reader, the sampler, the loop.
"""

from __future__ import annotations

import math
from datetime import timedelta
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from parallel.partition import DIM_NAMES, SplitError, block_bounds

if TYPE_CHECKING:  # not at run time: `python -m parallel.placement` must not import itself first
    from parallel.placement import Placement


def _as_spatial(spatial: Sequence[int]) -> tuple[int, int, int]:
    spatial = tuple(int(s) for s in spatial)
    if len(spatial) != 3 or any(s < 1 for s in spatial):
        raise ValueError(f"spatial must be three positive ints (sd, sh, sw), got {spatial}")
    return spatial  # type: ignore[return-value]


@dataclass
class Grid:
    """Where this rank sits in the (data x spatial) grid, and the groups to talk to.

    The geometry (coordinates, neighbours, block ranges) is plain arithmetic; the
    process groups are filled in by ``Grid.from_world`` once torch.distributed runs.
    """

    spatial: tuple[int, int, int]
    world_size: int
    rank: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    local_rank: int = 0
    spatial_group: Any = None
    data_group: Any = None
    world_group: Any = None
    grad_group: Any = None
    grad_data_group: Any = None   # the data group again, for sharded parameters' gradient averages
    grad_spatial_group: Any = None  # the spatial group again, for the hierarchical gradient sync (data and spatial > 1)
    launcher: str = "single"
    # Facts gathered once at start-up (``parallel.init``), so nothing later guesses them
    # from launcher variables: the node of every rank, the rendezvous store (the
    # watchdog's), and a CPU (gloo) group over the world for host-side exchanges.
    placement: Placement | None = None
    store_address: tuple[str, int] | None = None
    cpu_group: Any = None
    backend: str = "gloo"

    def __post_init__(self) -> None:
        self.spatial = _as_spatial(self.spatial)
        sd, sh, sw = self.spatial
        if self.world_size % self.spatial_size != 0:
            raise ValueError(
                f"the world size {self.world_size} is not a multiple of the spatial group "
                f"size {sd}x{sh}x{sw} = {self.spatial_size}: data x spatial({sd}x{sh}x{sw}) "
                f"cannot equal {self.world_size}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")

    # -- sizes and coordinates ------------------------------------------------------
    @property
    def spatial_size(self) -> int:
        return math.prod(self.spatial)

    @property
    def data_size(self) -> int:
        return self.world_size // self.spatial_size

    @property
    def data_rank(self) -> int:
        return self.rank // self.spatial_size

    @property
    def spatial_rank(self) -> int:
        return self.rank % self.spatial_size

    @property
    def local_size(self) -> int:
        """Ranks on this rank's node (without a placement: one node holds every rank)."""
        return self.placement.local_size(self.rank) if self.placement is not None else self.world_size

    @property
    def node_count(self) -> int:
        """Nodes of the job (without a placement: one)."""
        return self.placement.node_count if self.placement is not None else 1

    @property
    def ranks_per_node(self) -> int:
        """The most ranks any node holds (without a placement: the world)."""
        return self.placement.max_ranks_per_node if self.placement is not None else self.world_size

    @property
    def coords(self) -> tuple[int, int, int]:
        """This rank's block position along D, H and W."""
        return self.spatial_coords(self.spatial_rank)

    def spatial_coords(self, spatial_rank: int) -> tuple[int, int, int]:
        sd, sh, sw = self.spatial
        return (spatial_rank // (sh * sw), (spatial_rank // sw) % sh, spatial_rank % sw)

    def rank_at(self, coords: Sequence[int], data_rank: int | None = None) -> int:
        """The global rank of the block at ``coords`` in a data group (default: ours)."""
        sd, sh, sw = self.spatial
        cd, ch, cw = coords
        data_rank = self.data_rank if data_rank is None else data_rank
        return data_rank * self.spatial_size + (cd * sh + ch) * sw + cw

    def line_ranks(self, dim: int) -> list[int]:
        """Global ranks along tensor dim ``dim`` (2, 3 or 4) through this rank, in order."""
        axis = dim - 2
        coords = list(self.coords)
        ranks = []
        for i in range(self.spatial[axis]):
            coords[axis] = i
            ranks.append(self.rank_at(coords))
        return ranks

    def neighbors(self, dim: int, periodic: bool = False) -> tuple[int | None, int | None]:
        """Global ranks of the previous and next blocks along tensor dim ``dim``.

        ``None`` at a volume edge unless ``periodic`` (then the line wraps around).
        """
        axis = dim - 2
        line = self.line_ranks(dim)
        i, s = self.coords[axis], self.spatial[axis]
        if periodic:
            return line[(i - 1) % s], line[(i + 1) % s]
        return (line[i - 1] if i > 0 else None, line[i + 1] if i < s - 1 else None)

    # -- blocks of a global volume ----------------------------------------------------
    def block_range(self, volume: Sequence[int], coords: Sequence[int] | None = None) -> tuple[tuple[int, int], ...]:
        """``[start, stop)`` along D, H and W of the block at ``coords`` (default: ours)."""
        if len(volume) != 3:
            raise ValueError(f"a volume shape has three dims (D, H, W), got {tuple(volume)}")
        coords = self.coords if coords is None else coords
        ranges = []
        for axis, (n, parts) in enumerate(zip(volume, self.spatial)):
            try:
                ranges.append(block_bounds(int(n), parts)[coords[axis]])
            except SplitError as err:
                raise SplitError(
                    f"volume {tuple(volume)} cannot be split by spatial {self.spatial}: "
                    f"dim {DIM_NAMES[axis]} has {n} voxels for {parts} blocks"
                ) from err
        return tuple(ranges)

    def block_slices(self, volume: Sequence[int], coords: Sequence[int] | None = None) -> tuple[slice, slice, slice]:
        """Slices that cut this rank's block out of a (..., D, H, W) array."""
        return tuple(slice(a, b) for a, b in self.block_range(volume, coords))  # type: ignore[return-value]

    def batch_range(self, batch: int) -> tuple[int, int]:
        """``[start, stop)`` of the rows of a global batch that our data group takes."""
        if batch < self.data_size:
            raise SplitError(f"a global batch of {batch} cannot feed {self.data_size} data groups")
        return block_bounds(batch, self.data_size)[self.data_rank]

    def describe(self) -> str:
        sd, sh, sw = self.spatial
        return (
            f"rank {self.rank}/{self.world_size}: data {self.data_rank}/{self.data_size} x "
            f"spatial {sd}x{sh}x{sw} at {self.coords} on {self.device} ({self.launcher})"
        )

    # -- process groups ---------------------------------------------------------------
    @classmethod
    def from_world(cls, spatial: Sequence[int], device: torch.device | None = None,
                   local_rank: int = 0, launcher: str = "single", timeout: timedelta | None = None) -> "Grid":
        """Build the grid and its process groups over the running torch.distributed world.

        Every rank must call this with the same ``spatial`` (group creation is collective).
        ``timeout`` bounds each collective of the new groups, as the world's (torch gives a
        new group its own default, 30 minutes, not the world's).
        """
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call parallel.init() first")
        grid = cls(spatial=_as_spatial(spatial), world_size=dist.get_world_size(), rank=dist.get_rank(),
                   device=device or torch.device("cpu"), local_rank=local_rank, launcher=launcher)
        s, w = grid.spatial_size, grid.world_size
        grid.world_group = dist.group.WORLD
        spatial_lists = [list(range(d * s, (d + 1) * s)) for d in range(w // s)]
        data_lists = [list(range(r, w, s)) for r in range(s)]
        grid.spatial_group = _subgroup(spatial_lists, grid.rank, timeout)
        grid.data_group = _subgroup(data_lists, grid.rank, timeout)
        # Gradient all-reduces run asynchronously during the backward, beside the halo
        # exchanges and norm reductions: a group of their own keeps their order apart.
        grid.grad_group = dist.new_group(list(range(w)), timeout=timeout)
        grid.grad_data_group = _subgroup(data_lists, grid.rank, timeout)
        if s > 1 and w > s:  # the hierarchical sync's reduce-scatter and all-gather (parallel.model.gradsync)
            grid.grad_spatial_group = _subgroup(spatial_lists, grid.rank, timeout)
        return grid


def _subgroup(rank_lists: list[list[int]], rank: int, timeout: timedelta | None = None) -> Any:
    """Create every group of the partition (collectively) and return the one holding ``rank``."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine
