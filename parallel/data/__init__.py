"""Sample files, the block reader, the sampler and staging: each rank reads only its block.

The on-disk format is described in ``docs/data.md``. In short: HDF5, every field stored
with a leading sample axis (one or many samples per file), volume fields chunked so that
the chunks tile the block boundaries of the spatial splits the file was written for.

Public API (all importable from ``parallel.data``)::

    from parallel.data import (BlockDataset, GlobalShuffleSampler, PartialShuffleSampler,
                               make_loader, stage, check_files, StepStats)
    family = parallel.job.family.get(name)   # a model family: its sample spec and transform

    # A rank's view of a directory (or list) of sample files. Volume fields come back as
    # this rank's block (C, d, h, w) (or (d, h, w) for channel-less fields such as a
    # label), scalar fields whole; ``transform`` runs on the block in the worker.
    ds = BlockDataset("data/train", fields=family.spec.names, grid=grid,
                      transform=family.transform)    # e.g. log(x + 1) of counts, on the block
    # Families whose files differ in preprocessing pick it by the files' attributes:
    # transform=family.transform_for(ds.attrs).
    len(ds)                          # number of samples
    ds[i]                            # {"volume": Tensor(C, d, h, w), "target": Tensor(4)}
    ds.attrs                         # attributes of the first file (spec, codec, ...)

    # One global shuffle per epoch from a shared seed; data group r takes rows
    # grid.batch_range(global_batch) of every global batch, so the global batch does not
    # depend on the data-parallel size; every rank of a spatial group gets the same order.
    sampler = GlobalShuffleSampler(len(ds), grid, global_batch=8, seed=0, shuffle=True,
                                   drop_last=True)
    # or: PartialShuffleSampler(len(ds), grid, global_batch=8, seed=0, exchange=0.1)
    len(sampler)                     # steps per epoch (the same on every rank)

    loader = make_loader(ds, sampler, num_workers=2, prefetch_factor=2,
                         pin_memory=None,      # None: pin when CUDA is available
                         device=None)          # or a device: batches moved non-blocking
    loader.set_epoch(epoch)          # = sampler.set_epoch(epoch, start_step=0)
    for batch, stats in loader:      # batch: dict of stacked tensors (B_local, ...)
        stats.bytes_read             # stored bytes this step's samples read (chunks touched)
        stats.read_seconds           # seconds the workers spent reading them
        stats.wait_seconds           # seconds this step waited for its batch
        stats.samples
    loader.totals                    # StepStats summed over the epoch so far (.as_dict())
    loader.state_dict()              # {"kind", "seed", "epoch", "step"}: steps delivered
    loader.load_state_dict(state)    # resume at the next undelivered step

    # Staging to node-local storage before training (ranks of a node share the copying;
    # collective over torch.distributed when it is initialised).
    report = stage("data/train", "/dev/shm/train", grid, mode="shard",  # or "blocks"
                   local_size=ranks_per_node, indices=None)
    report.path, report.bytes, report.files, report.seconds      # this rank
    report.bytes_total, report.files_total, report.seconds_max   # all ranks
    ds = BlockDataset(report.path, ...)   # same sample numbering as the source
    # read_once=True: each file read once per job (not per node), the nodes exchanging over
    # the CPU group; checked (size, SHA-256) before it returns (StagingCheckError if not).

    # Validation of a prepared directory: (file, reason) for every problem found.
    problems = check_files("data/train", fields.SPEC)

    # Cases of different shapes and training crops: a region policy makes each rank read
    # its block of the sample's crop (edge padding where the crop leaves the case); the
    # crop is drawn from (seed, epoch, index), alike on every rank and grid. The loader
    # hands such a dataset (index, epoch) keys; samples carry REGION_KEY (start, size).
    ds = BlockDataset("data/kits/train", fields=("image", "label"), grid=grid,
                      regions=BalancedCrop((128, 128, 128), oversampling=0.4, seed=0))
    boxes = foreground_boxes(label, classes=3)   # at conversion: what the crop chooses from

Errors raised while reading (``SampleReadError``) name the file, the field, the sample
and the hyperslab; through DataLoader workers they reach the loop with that text.
"""

from parallel.data.check import check_file, check_files
from parallel.data.codecs import CODECS, codec_kwargs
from parallel.data.crops import REGION_KEY, BalancedCrop, FixedRegion, Region, balanced_crop, crop_rng
from parallel.data.foreground import foreground_boxes
from parallel.data.format import (
                                  FieldSpec,
                                  SampleSpec,
                                  choose_chunks,
                                  choose_crop_chunks,
                                  create_datasets,
                                  parse_splits,
                                  sample_files,
                                  write_manifest,
                                  write_samples,
)
from parallel.data.loader import BatchShapeError, BlockLoader, StepStats, make_loader
from parallel.data.reader import BlockDataset, CountingFile, SampleReadError, touched_chunk_bytes
from parallel.data.sampler import GlobalShuffleSampler, PartialShuffleSampler, ShardSampler
from parallel.data.readonce import StagingCheckError
from parallel.data.staging import StageReport, stage

__all__ = [
    "BalancedCrop", "BatchShapeError", "BlockDataset", "BlockLoader", "CODECS", "CountingFile", "FieldSpec",
    "FixedRegion", "GlobalShuffleSampler", "PartialShuffleSampler", "REGION_KEY", "Region", "SampleReadError",
    "SampleSpec", "ShardSampler", "StageReport", "StagingCheckError", "StepStats", "balanced_crop", "check_file", "check_files",
    "choose_chunks",
    "choose_crop_chunks", "codec_kwargs", "create_datasets", "crop_rng", "foreground_boxes", "make_loader",
    "parse_splits", "sample_files", "stage", "touched_chunk_bytes", "write_manifest", "write_samples",
]
