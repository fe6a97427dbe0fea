"""Samplers: which samples each data group reads at each step of an epoch.

Both are batch samplers (they yield the list of sample indices of this rank's local
batch) and are pure arithmetic on a shared seed: every rank computes every rank's
assignment without communicating, and all ranks of a spatial group (same data rank) get
the same indices in the same order.

- ``GlobalShuffleSampler``: one global permutation per epoch; step ``k`` takes global
  batch ``perm[k*G:(k+1)*G]`` and data group ``r`` its rows ``grid.batch_range(G)``. The
  global batch is therefore independent of the data-parallel size.
- ``ShardSampler`` (evaluation): data group ``r`` takes the ``r``-th contiguous share of
  the samples in file order (as ``np.array_split`` deals them), ``per_step`` at a time;
  groups with a shorter share get empty steps at the end (every group runs the same steps).
- ``PartialShuffleSampler``: each data group keeps a shard (from a global shuffle at
  epoch 0) that can live on node-local storage; every epoch a fraction ``exchange`` of
  each shard is pooled, shuffled and dealt back, then each shard is shuffled locally.
  ``exchange=0`` is pure local shuffling (no traffic, each group sees a fixed subset:
  convergence suffers at scale); ``exchange=1`` re-deals whole shards (as good as a
  global shuffle, and every epoch refetches a full shard). See docs/data.md.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import numpy as np

from parallel.partition import block_bounds

log = logging.getLogger(__name__)


def _rng(seed: int, *keys: int) -> np.random.Generator:
    # SeedSequence + PCG64 give the same stream on every platform and numpy version.
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), *map(int, keys)])))


def _rows(count: int, parts: int, part: int) -> tuple[int, int]:
    """Rows of a global batch of ``count`` that data group ``part`` of ``parts`` takes."""
    if count >= parts:
        return block_bounds(count, parts)[part]
    return (part, part + 1) if part < count else (count, count)


class _Base:
    def __init__(self, num_samples: int, grid: Any, global_batch: int, seed: int = 0,
                 drop_last: bool = True) -> None:
        self.num_samples = int(num_samples)
        self.data_size = grid.data_size if grid is not None else 1
        self.data_rank = grid.data_rank if grid is not None else 0
        self.global_batch = int(global_batch)
        if self.global_batch < self.data_size:
            raise ValueError(f"a global batch of {self.global_batch} cannot feed "
                             f"{self.data_size} data groups")
        self.seed = int(seed)
        self.drop_last = drop_last
        self.epoch = 0
        self.start_step = 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Select the epoch's order; ``start_step`` skips steps already taken (resume)."""
        self.epoch = int(epoch)
        self.start_step = int(start_step)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": type(self).__name__, "seed": self.seed, "epoch": self.epoch,
                "step": self.start_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind", type(self).__name__) != type(self).__name__:
            raise ValueError(f"state of a {state['kind']} cannot resume a {type(self).__name__}")
        if int(state["seed"]) != self.seed:
            log.warning("resuming with seed %d, the checkpoint used %d", self.seed, state["seed"])
        self.set_epoch(int(state["epoch"]), int(state.get("step", 0)))


class GlobalShuffleSampler(_Base):
    """One global shuffle per epoch from ``seed``, then rows of each global batch per group.

    Args:
        num_samples: samples in the dataset.
        grid: the process grid (``data_size``, ``data_rank``); None for one process.
        global_batch: samples per step over all data groups.
        shuffle: False keeps file order (validation).
        drop_last: drop the last incomplete global batch; otherwise it is split as evenly
            as possible (a data group may get an empty step: the loader still yields it).
    """

    def __init__(self, num_samples: int, grid: Any, global_batch: int, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True) -> None:
        super().__init__(num_samples, grid, global_batch, seed, drop_last)
        self.shuffle = shuffle
        if drop_last and self.num_samples < self.global_batch:
            raise ValueError(f"{self.num_samples} samples make no full global batch of "
                             f"{self.global_batch}; use drop_last=False or a smaller batch")

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.global_batch)
        return full + (1 if rest and not self.drop_last else 0)

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's global order of sample indices (the same on every rank)."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        return _rng(self.seed, 0, epoch).permutation(self.num_samples)

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order(self.epoch)
        g = self.global_batch
        for step in range(self.start_step, len(self)):
            rows = order[step * g:(step + 1) * g]
            a, b = _rows(len(rows), self.data_size, self.data_rank)
            yield rows[a:b].tolist()


class PartialShuffleSampler(_Base):
    """Node-local shards with a fraction ``exchange`` of each shard re-dealt every epoch.

    Data group ``r`` owns shard ``r``; shard sizes differ by at most one and stay fixed.
    ``shard(epoch)`` and ``incoming(epoch)`` tell staging what a group holds and what it
    must fetch before an epoch.
    """

    def __init__(self, num_samples: int, grid: Any, global_batch: int, seed: int = 0,
                 exchange: float = 0.1, drop_last: bool = True) -> None:
        super().__init__(num_samples, grid, global_batch, seed, drop_last)
        if not 0.0 <= exchange <= 1.0:
            raise ValueError(f"exchange is a fraction of each shard, in [0, 1]; got {exchange}")
        if self.num_samples < self.data_size:
            raise ValueError(f"{self.num_samples} samples cannot make {self.data_size} shards")
        self.exchange = float(exchange)
        self._cache: tuple[int, list[np.ndarray]] | None = None
        sizes = [b - a for a, b in block_bounds(self.num_samples, self.data_size)]
        locals_ = [b - a for a, b in (_rows(self.global_batch, self.data_size, r)
                                      for r in range(self.data_size))]
        # Every group runs the same number of steps (collectives), set by the tightest one.
        self._steps = min((s // lb if drop_last else -(-s // lb)) for s, lb in zip(sizes, locals_))
        self._local_batch = locals_[self.data_rank]

    def __len__(self) -> int:
        return self._steps

    def shards(self, epoch: int) -> list[np.ndarray]:
        """Every group's shard (unordered sets, as sorted arrays) at ``epoch``."""
        if self._cache is not None and self._cache[0] <= epoch:
            e, shards = self._cache[0], [s.copy() for s in self._cache[1]]
        else:
            perm = _rng(self.seed, 1).permutation(self.num_samples)
            e, shards = 0, [np.sort(perm[a:b]) for a, b in block_bounds(self.num_samples, self.data_size)]
        while e < epoch:
            e += 1
            rng = _rng(self.seed, 2, e)
            leaving = [rng.choice(len(s), size=int(round(self.exchange * len(s))), replace=False)
                       for s in shards]
            pool = rng.permutation(np.concatenate([s[i] for s, i in zip(shards, leaving)]))
            pos = 0
            for j, (s, i) in enumerate(zip(shards, leaving)):
                keep = np.delete(s, i)
                shards[j] = np.sort(np.concatenate([keep, pool[pos:pos + len(i)]]))
                pos += len(i)
        self._cache = (epoch, [s.copy() for s in shards])
        return shards

    def shard(self, epoch: int, data_rank: int | None = None) -> np.ndarray:
        """The sample indices data group ``data_rank`` (default: ours) holds at ``epoch``."""
        return self.shards(epoch)[self.data_rank if data_rank is None else data_rank]

    def incoming(self, epoch: int, data_rank: int | None = None) -> np.ndarray:
        """Samples new to the group's shard at ``epoch`` (to fetch before it starts)."""
        if epoch == 0:
            return self.shard(0, data_rank)
        return np.setdiff1d(self.shard(epoch, data_rank), self.shard(epoch - 1, data_rank))

    def __iter__(self) -> Iterator[list[int]]:
        mine = self.shard(self.epoch)
        order = _rng(self.seed, 3, self.epoch, self.data_rank).permutation(mine)
        lb = self._local_batch
        for step in range(self.start_step, self._steps):
            yield order[step * lb:(step + 1) * lb].tolist()


class ShardSampler(_Base):
    """Contiguous shares of the samples in file order, one per data group (evaluation).

    Args:
        num_samples: samples in the dataset.
        grid: the process grid; None for one process.
        per_step: samples each data group takes per step (its share's tail may be shorter).
    """

    def __init__(self, num_samples: int, grid: Any, per_step: int = 1) -> None:
        data_size = grid.data_size if grid is not None else 1
        super().__init__(num_samples, grid, global_batch=max(per_step, 1) * data_size, drop_last=False)
        self.per_step = max(int(per_step), 1)
        self.share = _rows(self.num_samples, self.data_size, self.data_rank)
        longest = max(b - a for a, b in (_rows(self.num_samples, self.data_size, r) for r in range(self.data_size)))
        self._steps = -(-longest // self.per_step)

    def __len__(self) -> int:
        return self._steps

    def __iter__(self) -> Iterator[list[int]]:
        a, b = self.share
        for step in range(self.start_step, self._steps):
            lo = a + step * self.per_step
            yield list(range(lo, min(lo + self.per_step, b))) if lo < b else []
