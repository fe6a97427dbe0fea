"""The loader: DataLoader workers with prefetch and pinned memory, and per-step I/O stats.

Each worker returns, with every sample, the bytes it read and the seconds it spent; the
loader sums them per step and measures how long the step waited for its batch, so the
training loop can report whether it is I/O bound.

Samples of one batch are stacked, so they must have one shape: crops (a region policy)
make them equal; whole cases of different shapes can only go one per rank and step, and
a batch that mixes shapes stops with ``BatchShapeError`` naming the files and shapes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import torch

from parallel.data.reader import BlockDataset, Key, Sample

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    """I/O of one step (or, summed, of an epoch) on this rank."""

    samples: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    wait_seconds: float = 0.0

    def __iadd__(self, other: "StepStats") -> "StepStats":
        self.samples += other.samples
        self.bytes_read += other.bytes_read
        self.read_seconds += other.read_seconds
        self.wait_seconds += other.wait_seconds
        return self

    def as_dict(self) -> dict[str, float]:
        """Plain numbers, for loggers and TensorBoard."""
        return asdict(self)


class BatchShapeError(ValueError):
    """Samples of one batch have different shapes (whole cases of different sizes)."""


class _WithStats(torch.utils.data.Dataset):
    """Wraps a BlockDataset so that each item carries its read accounting and its key."""

    def __init__(self, dataset: BlockDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Key) -> tuple[Sample, int, float, Key]:
        return (*self.dataset.load(key), key)


class _EpochKeys:
    """A batch sampler yielding ``(index, epoch)`` keys, for datasets whose region (a
    crop) depends on the epoch; length, epochs and state stay the wrapped sampler's."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = int(self.sampler.epoch)
        for batch in self.sampler:
            yield [(int(i), epoch) for i in batch]


class _Collate:
    """Stacks samples; an empty step (a tail too short for every data group) gets
    zero-length tensors of the right shapes, so every rank still runs the step."""

    def __init__(self, dataset: BlockDataset) -> None:
        self.dataset = dataset

    def __call__(self, items: list[tuple[Sample, int, float, Key]]) -> tuple[Sample, StepStats]:
        if not items:
            sample = self.dataset[0]
            return {k: v.unsqueeze(0)[:0] for k, v in sample.items()}, StepStats()
        for k in items[0][0]:
            shapes = [tuple(item[0][k].shape) for item in items]
            if len(set(shapes)) > 1:
                raise BatchShapeError(self._mixed(k, items, shapes))
        batch = {k: torch.stack([item[0][k] for item in items]) for k in items[0][0]}
        stats = StepStats(samples=len(items), bytes_read=sum(item[1] for item in items),
                          read_seconds=sum(item[2] for item in items))
        return batch, stats

    def _mixed(self, name: str, items: list[tuple[Sample, int, float, Key]], shapes: list[tuple[int, ...]]) -> str:
        where = []
        for item, shape in zip(items, shapes):
            path, row = self.dataset.locate(item[3])
            where.append(f"{path.name}[{row}] {shape}")
        return (f"a batch of {len(items)} samples cannot be stacked: field {name!r} has different shapes "
                f"({', '.join(where)}; this rank's blocks). Cases of different sizes train as crops of "
                "one size (data.crop=[D,H,W]) or one case per rank and step (global batch = data groups)")


def _worker_init(worker_id: int) -> None:
    # Workers share the rank's cores with the compute: one thread each.
    torch.set_num_threads(1)


class BlockLoader:
    """Iterates ``(batch, StepStats)`` for the sampler's current epoch.

    ``totals`` sums the stats of the epoch so far; ``state_dict`` records the epoch and
    the steps delivered (not the steps prefetched), so a resumed run restarts at the
    next undelivered step.
    """

    def __init__(self, dataset: BlockDataset, sampler: Any, loader: torch.utils.data.DataLoader,
                 device: torch.device | None) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.loader = loader
        self.device = device
        self.totals = StepStats()
        self.step = 0

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[tuple[Sample, StepStats]]:
        self.totals = StepStats()
        self.step = self.sampler.start_step
        it = iter(self.loader)
        while True:
            t0 = time.perf_counter()
            try:
                batch, stats = next(it)
            except StopIteration:
                return
            if self.device is not None:
                batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            stats.wait_seconds = time.perf_counter() - t0
            self.totals += stats
            self.step += 1
            yield batch, stats

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.sampler.set_epoch(epoch, start_step)

    def state_dict(self) -> dict[str, Any]:
        state = self.sampler.state_dict()
        state["step"] = self.step
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        self.step = int(state.get("step", 0))


def make_loader(dataset: BlockDataset, sampler: Any, num_workers: int = 2, prefetch_factor: int = 2,
                pin_memory: bool | None = None, device: torch.device | str | None = None,
                multiprocessing_context: str | None = None, persistent_workers: bool = False,
                seed: int | None = None) -> BlockLoader:
    """A loader over ``dataset`` in the batches ``sampler`` yields (lists of indices).

    A dataset with a region policy (crops) is given ``(index, epoch)`` keys, so each
    sample's crop is drawn for the sampler's current epoch.

    Args:
        num_workers: reader processes; each opens its own file handles. 0 reads inline.
        prefetch_factor: batches each worker reads ahead (workers > 0 only).
        pin_memory: page-lock batches for fast host-to-device copies; None pins when CUDA
            is available.
        device: when given, batches are moved there (non-blocking from pinned memory).
        seed: seeds a private generator for the workers' base seed (drawn at every epoch),
            so loading never consumes the global RNG (dropout masks stay reproducible on
            resume); None draws from the global RNG as torch's DataLoader does.
    """
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    kwargs: dict[str, Any] = {}
    if num_workers > 0:
        kwargs.update(prefetch_factor=prefetch_factor, worker_init_fn=_worker_init,
                      persistent_workers=persistent_workers,
                      multiprocessing_context=multiprocessing_context)
    batches = _EpochKeys(sampler) if getattr(dataset, "regions", None) is not None else sampler
    loader = torch.utils.data.DataLoader(_WithStats(dataset), batch_sampler=batches,
                                         num_workers=num_workers, collate_fn=_Collate(dataset),
                                         pin_memory=pin_memory, **kwargs,
                                         generator=None if seed is None else torch.Generator().manual_seed(seed))
    return BlockLoader(dataset, sampler, loader, torch.device(device) if device is not None else None)
