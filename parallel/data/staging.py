"""Staging: copy what a node needs to node-local storage before training.

Two modes:

- ``shard``: whole sample files holding the node's samples (``indices``; all samples
  when None, as a global shuffle needs), copied byte for byte;
- ``blocks``: only the blocks of the spatial positions of the node's ranks, written as
  smaller sample files under ``block_d{cd}h{ch}w{cw}/`` with ``global_shape`` and
  ``block_origin`` attributes, so that the reader finds its hyperslab in them.

The ranks of a node (as the placement gathered at start-up found them, or ``rank //
local_size`` when a caller says how many consecutive ranks a node holds) share the work
round-robin and wait for each other on the grid's CPU group (gloo, also beside NCCL).
The destination gets a manifest listing every
source file with its sample count and the source directory, so that
``BlockDataset(dest)`` keeps the global sample numbering and reads anything not staged
(e.g. samples a partial shuffle brings in) from the source.
Copies go to a temporary name and are renamed: an interrupted staging resumes, and
files already present (same size) are not copied again.

``read_once=True`` reads every file once per job instead of once per node, the nodes
handing each other what they need over the CPU group, and checks every staged file's
size and SHA-256 before returning (``parallel.data.readonce``). ``storage`` (a
``parallel.data.bandwidth.SharedBandwidth``, measurements only) is drawn from for every
byte read from the source.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

import h5py
import numpy as np
import torch

from parallel import comm
from parallel.data.accounting import read_bytes
from parallel.data.codecs import codec_kwargs
from parallel.data.format import MANIFEST, choose_chunks
from parallel.data.readonce import stage_read_once
from parallel.data.reader import _resolve, block_dir_name

log = logging.getLogger(__name__)


@dataclass
class StageReport:
    """What staging did. ``bytes``/``files``/``seconds``: this rank; ``*_total``: all
    ranks (``seconds_max``: the slowest rank) when torch.distributed runs."""

    path: Path
    bytes: int
    files: int
    seconds: float
    bytes_total: int
    files_total: int
    seconds_max: float
    source_bytes: int = 0
    """Bytes this rank read from the source (the shared file system)."""
    source_bytes_total: int = 0
    """Bytes all ranks read from the source."""


def _node_ranks(grid: Any, local_size: int | None) -> list[int]:
    """The ranks that share this rank's node: from the placement gathered at start-up
    (``grid.placement``) unless ``local_size`` says how many consecutive ranks a node holds;
    this rank alone when neither is known."""
    if local_size is None:
        placement = getattr(grid, "placement", None)
        return placement.node_ranks(grid.rank) if placement is not None else [grid.rank]
    node = grid.rank // local_size
    return list(range(node * local_size, min((node + 1) * local_size, grid.world_size)))


def stage(source: str | os.PathLike, dest: str | os.PathLike, grid: Any,
          mode: Literal["shard", "blocks"] = "shard", local_size: int | None = None,
          indices: Sequence[int] | np.ndarray | None = None, read_once: bool = False,
          storage: Any = None) -> StageReport:
    """Copy this node's share of ``source`` into ``dest``; collective when dist runs.

    Args:
        source: a prepared directory of sample files.
        dest: node-local directory (e.g. ``/dev/shm/train`` or ``$TMPDIR/train``).
        grid: the process grid (rank, world size, spatial split).
        mode: ``shard`` (whole files) or ``blocks`` (only the node's blocks).
        local_size: ranks per node, consecutive (None: the node's ranks as
            ``grid.placement`` found them at start-up).
        indices: global sample indices the node needs (e.g. the union of its data groups'
            ``PartialShuffleSampler.shard(0)``); None for all samples.
        read_once: split the reading of the source between all nodes, each file read once
            per job, and exchange over the CPU group (``parallel.data.readonce``); the
            staged files are checked (size, SHA-256) before this returns.
        storage: a shared bandwidth to draw the source's bytes from (measurements only).
    """
    t0 = time.perf_counter()
    source, dest = Path(source), Path(dest)
    files, counts, _ = _resolve(source, None)
    starts = np.concatenate([[0], np.cumsum(counts)])
    if indices is None:
        wanted = list(range(len(files)))
    else:
        idx = np.unique(np.asarray(indices, dtype=np.int64))
        wanted = sorted(set((np.searchsorted(starts, idx, side="right") - 1).tolist()))
    ranks = _node_ranks(grid, local_size)
    if mode not in ("shard", "blocks"):
        raise ValueError(f"staging mode {mode!r}: choose 'shard' or 'blocks'")
    if read_once:
        done = stage_read_once(files, dest, grid, mode, local_size, wanted, storage)
        nbytes, nfiles, source_bytes = done["bytes"], done["files"], done["source_bytes"]
    else:
        nbytes, nfiles, source_bytes = _stage_each_node(files, dest, grid, mode, ranks, wanted, storage)
    _barrier(grid)
    if ranks.index(grid.rank) == 0:
        _write_manifest(dest, source, files, counts, mode == "blocks")
    _barrier(grid)
    seconds = time.perf_counter() - t0
    totals = [float(nbytes), float(nfiles), float(source_bytes)]
    seconds_max = seconds
    group = _cpu_group(grid)
    if comm.group_size(group) > 1:
        device = comm.group_device(group)
        totals = comm.all_reduce_(torch.tensor(totals, dtype=torch.float64, device=device), group).tolist()
        slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
        seconds_max = float(comm.all_reduce_(slowest, group, "max"))
    log.info("staged %d files, %.1f MB in %.1f s on rank %d (all ranks: %d files, %.1f MB; %d bytes read from "
             "the source)", nfiles, nbytes / 1e6, seconds, grid.rank, totals[1], totals[0] / 1e6, int(totals[2]))
    return StageReport(path=dest, bytes=nbytes, files=nfiles, seconds=seconds,
                       bytes_total=int(totals[0]), files_total=int(totals[1]), seconds_max=seconds_max,
                       source_bytes=source_bytes, source_bytes_total=int(totals[2]))


def _stage_each_node(files: list[Path], dest: Path, grid: Any, mode: str, ranks: list[int], wanted: list[int],
                     storage: Any) -> tuple[int, int, int]:
    """Today's staging: each node copies what it needs, its ranks sharing the files;
    bytes written, files written and bytes read from the source by this rank."""
    if mode == "shard":
        jobs: list[tuple[int, tuple[int, int, int] | None]] = [(i, None) for i in wanted]
    else:
        positions = sorted({grid.spatial_coords(r % grid.spatial_size) for r in ranks})
        jobs = [(i, c) for c in positions for i in wanted]
    local_rank = ranks.index(grid.rank)
    nbytes = nfiles = source = 0
    for i, coords in jobs[local_rank::len(ranks)]:
        if coords is None:
            n = _copy_file(files[i], dest / files[i].name)
            source += n
        else:
            out = dest / block_dir_name(coords) / files[i].name
            n, read = _copy_block(files[i], out, grid, coords)
            source += read
        if storage is not None:
            storage.draw(n if coords is None else read)
        nbytes += n
        nfiles += 1
    return nbytes, nfiles, source


def _cpu_group(grid: Any) -> Any:
    """The grid's CPU (gloo) group of the world: a node that copies slower only keeps the
    others waiting on the host, never inside an NCCL collective, whose watchdog would
    abort the job after its timeout. None (the default group) for a grid without one."""
    return getattr(grid, "cpu_group", None)


def _barrier(grid: Any) -> None:
    # The world, not a node group: creating node groups would itself be collective, and
    # staging happens once, before training.
    comm.barrier(_cpu_group(grid), caller="staging")


def _copy_file(src: Path, out: Path) -> int:
    """Copy one file unless an equal-sized copy exists; the bytes copied."""
    size = src.stat().st_size
    if out.exists() and out.stat().st_size == size:
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, out)
    return size


def _copy_block(src: Path, out: Path, grid: Any, coords: tuple[int, int, int]) -> tuple[int, int]:
    """Write the block at ``coords`` of every sample of ``src`` as a smaller sample file;
    the bytes written and the bytes read from ``src`` (the reader's accounting).

    A block already staged is kept only if it was cut for the same split: a staging
    directory reused with another grid holds other extents under the same block name.
    """
    if out.exists():
        try:
            with h5py.File(out, "r") as g:
                splits = tuple(int(v) for v in np.asarray(g.attrs.get("splits", ())).ravel())
                recorded = "block_shape" in g.attrs
        except OSError:
            splits, recorded = (), False
        if splits == tuple(grid.spatial) and recorded:
            return 0, 0
        log.info("%s was staged for spatial %s, not %s: staging it again", out, list(splits), list(grid.spatial))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    read = 0
    try:
        with h5py.File(src, "r", rdcc_nbytes=0) as f, h5py.File(tmp, "w") as g:
            shape = tuple(int(s) for s in f.attrs.get("global_shape", ()))
            origin = np.asarray(f.attrs.get("block_origin", (0, 0, 0)), dtype=np.int64)
            if len(shape) != 3 or origin.any():
                raise ValueError(f"{src}: not a full-volume sample file (global_shape {shape}, "
                                 f"block_origin {origin.tolist()})")
            ranges = grid.block_range(shape, coords)
            codec = str(f.attrs.get("codec", "none"))
            for key, value in f.attrs.items():
                g.attrs[key] = value
            for name, dset in f.items():
                if dset.ndim >= 4 and tuple(dset.shape[-3:]) == shape:
                    sel = (Ellipsis,) + tuple(slice(a, b) for a, b in ranges)
                    read += read_bytes(dset, (slice(0, dset.shape[0]),) + tuple(slice(0, n) for n in dset.shape[1:-3])
                                       + sel[1:])
                    block = dset[sel]
                    channels = block.shape[1] if block.ndim == 5 else None
                    chunks = choose_chunks(block.shape[-3:], [(1, 1, 1)], channels, block.dtype.itemsize)
                    chunks = (min(chunks[0], block.shape[0]),) + chunks[1:]
                    g.create_dataset(name, data=block, chunks=chunks, **codec_kwargs(codec))
                else:
                    g.create_dataset(name, data=dset[...])
                    read += dset.size * dset.dtype.itemsize
            g.attrs["block_origin"] = np.asarray([a for a, _ in ranges], dtype=np.int64)
            g.attrs["block_shape"] = np.asarray([b - a for a, b in ranges], dtype=np.int64)
            g.attrs["splits"] = np.asarray([grid.spatial], dtype=np.int64)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OSError(f"{src}: cannot stage the block at {coords}: {err}") from err
    os.replace(tmp, out)
    return out.stat().st_size, read


def _write_manifest(dest: Path, source: Path, files: list[Path], counts: list[int], blocks: bool) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    manifest = {"staged": True, "blocks": blocks, "source": str(source.resolve()),
                "files": [{"name": p.name, "samples": int(n)} for p, n in zip(files, counts)]}
    tmp = dest / f"{MANIFEST}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=1)
    os.replace(tmp, dest / MANIFEST)
