"""Reading benchmarks: bytes and MB/s of block reads against whole-sample and raw reads per
codec (``io``), and the share of a training step spent waiting for data (``loader``), on
synthetic samples of the default family. ``scripts/benchmark_io.py`` uses the same reads."""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from parallel.bench.shared import Rows, plot
from parallel.bench.timing import load
from parallel.data import BlockDataset, parse_splits, write_samples
from parallel.data.format import SampleSpec
from parallel.grid import Grid
from parallel.job.family import Family, get, names


def synthetic_samples(family: Family, count: int, size: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Samples ``0..count-1`` of the family's synthetic training split (field arrays)."""
    if family.synthetic is None:
        raise SystemExit(f"model family {family.name!r} has no synthetic sample maker for the I/O benchmarks")
    return [family.synthetic(seed, 0, i, size) for i in range(count)]


def write_files(directory: Path, spec: SampleSpec, samples: Sequence[Mapping[str, np.ndarray]],
                splits: Sequence[Sequence[int]], codec: str) -> list[Path]:
    """One file ``s<i>.h5`` per sample, chunked for ``splits`` and compressed with ``codec``."""
    return [write_samples(directory / f"s{i}.h5", spec, {k: v[None] for k, v in s.items()}, splits, codec)
            for i, s in enumerate(samples)]


def read_all(ds: BlockDataset, n: int) -> tuple[float, int, int]:
    """Seconds, stored bytes read and decoded bytes delivered for samples 0..n-1."""
    t0 = time.perf_counter()
    stored = decoded = 0
    for i in range(n):
        sample, nbytes, _ = ds.load(i)
        stored += nbytes
        decoded += sum(t.numel() * t.element_size() for t in sample.values())
    return time.perf_counter() - t0, stored, decoded


def read_pattern(files: list[Path], grid: Grid | None, repeat: int) -> dict[str, float]:
    """Best of ``repeat`` passes reading every file as ``grid``'s rank would (None: whole)."""
    best = math.inf
    for _ in range(repeat):
        ds = BlockDataset(files, grid=grid)
        seconds, stored, decoded = read_all(ds, len(ds))
        ds.close()
        best = min(best, seconds)
    n = len(files)
    return {"bytes_read_per_sample": stored / n, "seconds_per_sample": best / n,
            "decoded_MBps": decoded / best / 1e6, "stored_MBps": stored / best / 1e6}


def raw_read(files: list[Path], repeat: int) -> float:
    """Best seconds to read the files' bytes sequentially (no HDF5, no decoding)."""
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        for f in files:
            with open(f, "rb") as fh:
                while fh.read(4 << 20):
                    pass
        best = min(best, time.perf_counter() - t0)
    return best


def raw_bytes(path: Path, nbytes: int) -> float:
    """Seconds to read the first ``nbytes`` of ``path`` sequentially into freshly allocated
    memory, as a block read delivers into a new array (no HDF5, no decoding)."""
    out = np.empty(nbytes, np.uint8)
    view = memoryview(out)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        got = 0
        while got < nbytes:
            n = fh.readinto(view[got:got + (64 << 20)])
            if not n:
                break
            got += n
    return time.perf_counter() - t0


def drop_cache(files: Sequence[Path]) -> bool:
    """Evict the files from the page cache (``posix_fadvise(DONTNEED)`` after an fsync: no
    privileges needed, unlike ``/proc/sys/vm/drop_caches``); False where unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def drop_caches_permitted() -> bool:
    """Whether this process may write ``/proc/sys/vm/drop_caches`` (root only, as a rule)."""
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def block_vs_raw(files: list[Path], grid: Grid, trials: int, cold: bool) -> dict[str, Any]:
    """One rank's block reads against raw sequential reads of as many bytes, in interleaved
    trials (page cache warm, or dropped before every read): medians of per-trial ratios."""
    ds = BlockDataset(files, grid=grid)
    ratios, block_s, raw_s, nbytes = [], [], [], 0
    for t in range(trials + (0 if cold else 1)):
        b = r = 0.0
        for i, f in enumerate(files):
            order = ("block", "raw") if (t + i) % 2 == 0 else ("raw", "block")
            for kind in order:
                if cold:
                    drop_cache([f])
                if kind == "block":
                    t0 = time.perf_counter()
                    _, n, _ = ds.load(i)
                    b += time.perf_counter() - t0
                    nbytes = n
                else:
                    r += raw_bytes(f, nbytes or f.stat().st_size // max(grid.spatial_size, 1))
        if cold or t > 0:  # warm: the first pass warms the cache and the handles
            block_s.append(b)
            raw_s.append(r)
            ratios.append(r / b)
    ds.close()
    mb = nbytes * len(files) / 1e6
    return {"bytes_per_sample": nbytes, "block_MBps": mb / statistics.median(block_s),
            "raw_MBps": mb / statistics.median(raw_s), "block_over_raw": statistics.median(ratios),
            "spread": [min(ratios), max(ratios)]}


# -- io ---------------------------------------------------------------------------------

def io_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="64", help="sample cube edges, comma-separated (e.g. 128,256)")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--spatial", default="2,4,2x2x1")
    p.add_argument("--codecs", default="none,gzip,lz4,zstd,blosc2")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--trials", type=int, default=3, help="interleaved block/raw trials per rank")
    p.add_argument("--cold", action="store_true", help="also measure with the page cache dropped before each read")
    p.add_argument("--dir", type=Path, default=None, help="where to write the samples (default: a temporary "
                                                           "directory; point it at the storage to measure)")


def io(args: argparse.Namespace) -> Rows:
    """Bytes and MB/s per rank: block reads vs whole-sample reads vs raw sequential reads."""
    family = get(names()[0])
    splits = parse_splits(args.spatial)
    summary: dict[str, Any] = {"kind": "summary", "command": "io", "load_before": load(),
                               "drop_caches_permitted": drop_caches_permitted(),
                               "includes": "*_block_over_raw_warm: a rank's HDF5 block reads (decoding included) "
                                           "against raw sequential reads of as many bytes into new memory, page "
                                           "cache warm, medians of per-trial ratios of interleaved trials, the "
                                           "slowest rank; *_speedup: whole-sample read time over the slowest "
                                           "rank's block read time; *_bytes_share: bytes read per rank over the "
                                           "whole sample's",
                               "cold_method": "posix_fadvise(DONTNEED)" if args.cold else None}
    speedups: dict[str, dict[str, float]] = {}
    tmp = tempfile.TemporaryDirectory(dir=args.dir) if args.dir is None or args.dir.is_dir() else None
    root = Path(tmp.name) if tmp is not None else Path(args.dir)
    try:
        for size in (int(v) for v in str(args.size).split(",")):
            samples = synthetic_samples(family, args.samples, size)
            for codec in args.codecs.split(","):
                d = root / f"{size}_{codec.replace(':', '_')}"
                d.mkdir(parents=True)
                files = write_files(d, family.spec, samples, splits, codec)
                row = _io_row(args, files, splits, codec, size, summary)
                speedups[f"{codec}" if len(str(args.size).split(",")) == 1 else f"{codec} {size}"] = {
                    k: v["speedup_over_whole"] for k, v in row["blocks"].items()}
                yield row
                for f in files:
                    f.unlink()
            del samples
    finally:
        if tmp is not None:
            tmp.cleanup()

    def draw(ax: Any) -> None:
        grids = list(next(iter(speedups.values())).keys()) if speedups else []
        width = 0.8 / max(len(speedups), 1)
        for i, (codec, by_grid) in enumerate(speedups.items()):
            ax.bar([g + i * width for g in range(len(grids))], [by_grid[k] for k in grids], width, label=codec)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(grids))], grids)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xlabel("spatial split")
        ax.set_ylabel("per-rank read speedup over whole samples")
        ax.set_title(f"block reads, {args.size}^3")
        ax.legend(fontsize=7)

    summary["plot"] = plot(args, "io", draw)
    summary["load_after"] = load()
    yield summary


def _io_row(args: argparse.Namespace, files: list[Path], splits: Sequence[Sequence[int]], codec: str, size: int,
            summary: dict[str, Any]) -> dict[str, Any]:
    """One codec at one size: whole and block reads, and block against raw reads."""
    n = len(files)
    stored = sum(f.stat().st_size for f in files)
    raw_s = raw_read(files, args.repeat)
    fresh_s = min(sum(raw_bytes(f, f.stat().st_size) for f in files) for _ in range(args.repeat))
    whole = read_pattern(files, None, args.repeat)
    tag = f"{codec}_{size}" if len(str(args.size).split(",")) > 1 else codec
    row: dict[str, Any] = {"kind": "io", "codec": codec, "size": size, "file_bytes_per_sample": stored / n,
                           "raw_read_MBps": stored / raw_s / 1e6, "raw_fresh_MBps": stored / fresh_s / 1e6,
                           "whole": whole, "blocks": {}}
    for spatial in splits:
        s = math.prod(spatial)
        grids = [Grid(spatial=spatial, world_size=s, rank=r) for r in range(s)]
        ranks = [read_pattern(files, g, args.repeat) for g in grids]
        worst = max(ranks, key=lambda r: r["seconds_per_sample"])
        key = "x".join(map(str, spatial))
        # Against a raw read of as many bytes: the slowest rank's ratio, warm (and cold).
        warm = min((block_vs_raw(files, g, args.trials, False) for g in grids), key=lambda r: r["block_over_raw"])
        entry = {
            "bytes_read_per_rank_per_sample": max(r["bytes_read_per_sample"] for r in ranks),
            "share_of_whole_bytes": max(r["bytes_read_per_sample"] for r in ranks) / whole["bytes_read_per_sample"],
            "rank_stored_MBps": worst["stored_MBps"],
            "speedup_over_whole": whole["seconds_per_sample"] / worst["seconds_per_sample"],
            "warm": warm,
        }
        summary[f"{tag}_{key}_bytes_share"] = entry["share_of_whole_bytes"]
        summary[f"{tag}_{key}_speedup"] = entry["speedup_over_whole"]
        summary[f"{tag}_{key}_block_over_raw_warm"] = warm["block_over_raw"]
        if args.cold:
            entry["cold"] = block_vs_raw(files, grids[0], args.trials, True)
            summary[f"{tag}_{key}_block_over_raw_cold"] = entry["cold"]["block_over_raw"]
        row["blocks"][key] = entry
    # Into fresh memory both (the sample is a new array): the whole-sample read's share of the raw speed.
    summary[f"{tag}_whole_over_raw_throughput"] = whole["stored_MBps"] / row["raw_fresh_MBps"]
    return row


# -- loader -----------------------------------------------------------------------------

def loader_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--codecs", default="none,zstd")
    p.add_argument("--workers", default="0,1")
    p.add_argument("--set", nargs="*", default=["model.conv_filters=16"],
                   help="model overrides of the default family")


def loader(args: argparse.Namespace) -> Rows:
    """Share of the step time spent waiting for data (the default family, serial and spatial 2)."""
    from parallel.bench.ranks import run_ranks
    from parallel.bench.step import loader_share

    family = get(names()[0])
    samples = synthetic_samples(family, args.samples, args.size)
    summary: dict[str, Any] = {"kind": "summary", "command": "loader", "load_before": load()}
    with tempfile.TemporaryDirectory() as tmp:
        for codec in args.codecs.split(","):
            d = Path(tmp) / codec.replace(":", "_")
            d.mkdir()
            files = [str(f) for f in write_files(d, family.spec, samples, [(1, 1, 1), (2, 1, 1)], codec)]
            for workers in (int(w) for w in args.workers.split(",")):
                for spatial in ((1, 1, 1), (2, 1, 1)):
                    world = math.prod(spatial)
                    r = run_ranks(world, loader_share, files, family.name, args.size, args.set, args.batch,
                                  workers, args.steps, spatial=spatial)
                    share = max(x["wait_share"] for x in r)
                    yield {"kind": "loader", "codec": codec, "workers": workers, "spatial": list(spatial),
                           "seconds_per_step": max(x["seconds"] for x in r) / max(r[0]["steps"], 1),
                           "wait_share": share}
                    summary[f"{codec}_workers{workers}_spatial{world}_wait_share"] = share
    summary["load_after"] = load()
    yield summary
