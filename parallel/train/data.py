"""The training job's readers: block datasets, samplers and loaders for train and val.

Each rank reads only its block of each sample (``parallel.data.BlockDataset``); the
training sampler shuffles globally from the job seed and gives each data group its rows
of every global batch, so the global batch does not depend on the data-parallel size.
The loaders yield ``(Batch, StepStats)``: the batch's fields and, when
``data.nonfinite=skip``, which samples' input blocks are finite on this rank.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from parallel.data import BlockDataset, GlobalShuffleSampler, ShardSampler, make_loader, stage
from parallel.data.crops import REGION_KEY, BalancedCrop
from parallel.data.loader import StepStats
from parallel.data.reader import SampleReadError
from parallel.grid import Grid
from parallel.infer.windows import WindowCrop
from parallel.job.config import DataConfig, EvalConfig, TrainConfig
from parallel.job.family import Family
from parallel.train.checks import SampleFacts, train_volume, window
from parallel.train.prefetch import AheadCopies, copies_ahead

log = logging.getLogger("parallel.train")


@dataclass
class Batch:
    """One step's local batch."""

    fields: dict[str, torch.Tensor]
    """The sample fields, stacked along a leading batch dim."""
    finite: torch.Tensor | None = None
    """With ``data.nonfinite=skip``: (n,) bool, whether each sample's input block on this
    rank is finite (the step all-reduces it over the spatial group); else None."""


class CheckedDataset(BlockDataset):
    """A ``BlockDataset`` that checks each block after the transform: a non-finite target
    always fails; a non-finite input fails (``nonfinite="fail"``) or is flagged for the
    loop to skip (``"skip"``: ``input_finite(sample)`` says which). Errors name the file,
    field, sample and this rank's block."""

    # The flag travels through the DataLoader's workers and collation with the sample's
    # fields; ``Batches`` takes it out again into ``Batch.finite``.
    _FLAG = "_input_finite"

    @classmethod
    def input_finite(cls, sample: dict[str, torch.Tensor]) -> bool | None:
        """Whether a loaded sample's input block is finite (None: not checked, ``"fail"``)."""
        flag = sample.get(cls._FLAG)
        return None if flag is None else bool(flag)

    def __init__(self, *args: Any, input_field: str, target_field: str, nonfinite: str = "fail",
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.input_field, self.target_field, self.nonfinite = input_field, target_field, str(nonfinite)

    def load(self, index: int) -> tuple[dict[str, torch.Tensor], int, float]:
        sample, nbytes, seconds = super().load(index)
        for name in (self.target_field, self.input_field):
            value = sample[name]
            if not value.is_floating_point():
                continue
            bad = int(value.numel() - torch.isfinite(value).sum())
            if bad == 0:
                continue
            path, row = self.locate(index)
            where = f"{path}: field {name!r} sample {row}"
            if name == self.input_field and self.nonfinite == "skip":
                log.warning("%s: %d non-finite values in this rank's block; the sample is skipped", where, bad)
                sample[self._FLAG] = torch.tensor(False)
                return sample, nbytes, seconds
            block = ""
            if self.grid is not None and self.grid.spatial_size > 1 and name == self.input_field:
                block = f" in this rank's block {self._block(sample)}"
            hint = " (data.nonfinite=skip skips such samples)" if name == self.input_field else ""
            raise SampleReadError(f"{where}: {bad} non-finite values (NaN or inf) after the transform{block}, "
                                  f"want all finite{hint}")
        if self.nonfinite == "skip":
            sample[self._FLAG] = torch.tensor(True)
        return sample, nbytes, seconds

    def _block(self, sample: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
        """This rank's block in the case's coordinates: of the region read (a crop), or of the case."""
        region = sample.get(REGION_KEY)
        if region is not None:
            start, size = region[:3].tolist(), region[3:].tolist()
            return [(a + s, b + s) for (a, b), s in zip(self.grid.block_range(tuple(size)), start)]
        shape = self.attrs.get("global_shape")
        return list(self.grid.block_range(tuple(int(s) for s in shape))) if shape is not None else []


class Batches:
    """A loader's steps as ``(Batch, StepStats)`` (the loader itself yields plain dicts).
    ``ahead``: a CUDA device the batches are copied to one step ahead, on a side stream
    from pinned memory (``parallel.train.prefetch``); None: the loader's tensors as they are."""

    def __init__(self, loader: Any, ahead: torch.device | None = None) -> None:
        self.loader = loader
        self.ahead = ahead

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.loader.set_epoch(epoch, start_step)

    def __iter__(self) -> Iterator[tuple[Batch, StepStats]]:
        source = AheadCopies(self.loader, self.ahead) if self.ahead is not None else self.loader
        for fields, stats in source:
            finite = fields.pop(CheckedDataset._FLAG, None)
            fields.pop(REGION_KEY, None)  # where a crop was taken: the reader's business, not the step's
            yield Batch(fields, finite), stats


@dataclass
class JobData:
    """The readers of a job and what the loop needs to know about them."""

    train: Batches
    val: Batches
    n_train: int
    n_val: int
    volume: tuple[int, int, int]
    """What the network trains on: the crop, or the cases' volume."""
    staging_seconds: float = 0.0
    fixed_volume: tuple[int, int, int] | None = None
    """The global (D, H, W) of every training batch (a crop, or cases of one shape); None
    where cases of several shapes are trained whole (one per data group and step)."""


def fixed_shapes(pmodel: Any, data: JobData) -> contextlib.AbstractContextManager:
    """Where every training batch has one volume, the training steps' forwards take their
    global shape from it: no all-gather of block sizes per forward and micro-batch."""
    if data.fixed_volume is None or not hasattr(pmodel, "fixed_input"):
        return contextlib.nullcontext()
    return pmodel.fixed_input(data.fixed_volume)


def split_dir(data: DataConfig, split: str, family: Family) -> Path:
    """``data.dir/<split>``, with an error that says how to make it when it is missing."""
    sub = data.train_subdir if split == "train" else data.val_subdir
    path = Path(data.dir) / sub
    if not path.is_dir():
        raise FileNotFoundError(
            f"data.dir={data.dir!r} has no {sub}/ directory ({path}); generate a set with "
            f"{family.prepare_hint(data.dir)} or point data.dir at one"
        )
    return path


def _count(n: int, limit: int, key: str, path: Path) -> int:
    if n == 0:
        raise FileNotFoundError(f"{path} holds no samples")
    if limit and limit > n:
        log.warning("%s=%d but %s holds only %d samples", key, limit, path, n)
    return min(n, limit) if limit else n


def _loader(ds: BlockDataset, sampler: Any, data: DataConfig, grid: Grid, seed: int, ahead: bool = False) -> Any:
    """``ahead``: leave the batches in (pinned) host memory; ``Batches`` copies them to the
    GPU one step ahead (``parallel.train.prefetch``)."""
    loader = make_loader(ds, sampler, num_workers=data.workers,
                         prefetch_factor=max(data.prefetch, 1), device=None if ahead else grid.device,
                         persistent_workers=data.workers > 0, seed=seed)
    # seed: a private generator for the workers' base seed keeps the global RNG (plain
    # dropout) independent of data loading, so a resumed run draws the same dropout masks.
    return loader


def build_data(data: DataConfig, ev: EvalConfig, train: TrainConfig, family: Family, grid: Grid,
               facts: SampleFacts) -> JobData:
    """Stage (if asked) and open the train and val splits for this rank (samples of
    ``facts.volume``, as the job's checks found them); ``data``, ``ev``, ``train``: the
    job's data, eval and train sections (the crop and readers; the sliding window; the
    seed and the batches)."""
    fields = (family.input_field, family.target_field)
    train_dir = split_dir(data, "train", family)
    val_dir = split_dir(data, "val", family)
    t0 = time.perf_counter()
    sliding = str(ev.mode) == "sliding"
    if data.stage_dir:
        # a rank's block of a crop or of a window's kept part lies anywhere in the case: whole files
        blocks = data.stage_blocks_only
        modes = ["blocks" if blocks and data.crop is None else "shard",
                 "blocks" if blocks and not sliding else "shard"]
        if blocks and "shard" in modes:
            log.info("staging whole files of %s: crops and sliding windows read anywhere in a case",
                     " and ".join(n for n, m in zip(("train", "val"), modes) if m == "shard"))
        once = data.stage_read_once
        train_dir = Path(stage(str(train_dir), str(Path(data.stage_dir) / "train"), grid, mode=modes[0],
                               read_once=once).path)
        val_dir = Path(stage(str(val_dir), str(Path(data.stage_dir) / "val"), grid, mode=modes[1],
                             read_once=once).path)
    staging = time.perf_counter() - t0
    check = dict(input_field=family.input_field, target_field=family.target_field)
    crops = None
    if data.crop is not None:
        oversampling = data.oversampling if family.crop_boxes else 0.0
        crops = BalancedCrop(data.crop, oversampling, seed=train.seed, boxes_field=family.crop_boxes or "")
    train_ds = CheckedDataset(train_dir, fields=fields, grid=grid, transform=family.transform,
                              max_open_files=data.max_open_files, nonfinite=str(data.nonfinite),
                              regions=crops, **check)
    # Validation never skips: a metric over fewer samples would not be the metric.
    windows = WindowCrop(window(ev, data.crop), ev.overlap) if sliding else None  # type: ignore[arg-type]
    val_ds = CheckedDataset(val_dir, fields=fields, grid=grid, transform=family.transform,
                            max_open_files=data.max_open_files, nonfinite="fail", regions=windows, **check)
    if family.transform_for is not None:
        train_ds.transform = family.transform_for(train_ds.attrs)
        val_ds.transform = family.transform_for(val_ds.attrs)
    n_train = _count(len(train_ds), data.max_train_samples, "data.max_train_samples", train_dir)
    n_val = _count(len(val_ds), data.max_val_samples, "data.max_val_samples", val_dir)
    g = train.global_batch_size
    per_step = grid.data_size * train.accum_steps
    if g % per_step != 0:
        raise ValueError(
            f"train.global_batch_size={g} does not divide into data groups ({grid.data_size}) x "
            f"train.accum_steps ({train.accum_steps}) = {per_step} equal micro-batches"
        )
    if n_train < g:
        raise ValueError(f"{train_dir} holds {n_train} samples, fewer than train.global_batch_size={g}")
    train_sampler = GlobalShuffleSampler(n_train, grid, global_batch=g, seed=train.seed,
                                         shuffle=True, drop_last=True)
    # evaluation: contiguous shares of the cases per data group, as the reference deals them;
    # one case per step where they differ in shape or the sliding window takes them one by one
    ahead = copies_ahead(grid.device)  # training batches: copied ahead on a side stream (CUDA)
    eval_batch = train.eval_batch_size or g
    one_by_one = sliding or len({shape for _, shape in facts.val_shapes}) > 1
    val_sampler = ShardSampler(n_val, grid, per_step=1 if one_by_one else max(eval_batch // grid.data_size, 1))
    return JobData(
        train=Batches(_loader(train_ds, train_sampler, data, grid, train.seed + 1, ahead),
                      grid.device if ahead else None),
        val=Batches(_loader(val_ds, val_sampler, data, grid, train.seed + 2)),
        n_train=n_train, n_val=n_val, volume=train_volume(data.crop, facts.volume), staging_seconds=staging,
        fixed_volume=train_volume(data.crop, facts.volume) if data.crop is not None
        or len({tuple(shape) for _, shape in facts.train_shapes}) <= 1 else None,
    )
