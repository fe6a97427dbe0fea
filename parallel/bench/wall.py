"""The shared file system as the wall: time per epoch against the number of ranks at a
fixed aggregate storage bandwidth, for each way to read (``benchmark.py wall``).

Every rank reads through one ``SharedBandwidth`` (``parallel.data.bandwidth``): the
reader reads the file at the local disk's speed, then draws the bytes it read (its own
accounting) from a budget of ``--bandwidth`` bytes/s that all processes share; staging
draws every byte it reads from the source. Reads of staged copies (node-local storage)
draw nothing. Ranks are grouped as nodes of ``--local-size`` consecutive ranks; the
grid is data x spatial with ``--spatial`` ranks per sample (one node = one spatial
group by default), one sample per data group and step (the global batch is the data
groups), and a global shuffle.

A step's compute is a sleep of ``--compute`` seconds per sample divided by the spatial
ranks (the stand-in for the network: a sleep costs no CPU, so the two shared cores of
this machine do not blur the wall); a reader thread works two steps ahead, as the
loader's worker and prefetch do; a barrier ends each step (the gradient all-reduce).
Measures (``--measures``): ``whole`` (every rank reads whole samples), ``blocks`` (each
rank its block), ``blocks-<codec>`` (files written with a codec), ``stage`` (today's
staging of whole files: every node copies the data set) and ``once`` (read-once
staging); ``stage`` and ``once`` may name a codec too (``once-zstd``). Each runs ``--epochs`` epochs; time per epoch = (staging + epochs) / epochs.
Measures run interleaved, ``--repeat`` times, the median kept. Beside each, the
planner's prediction (``parallel.plan.io``) from the same figures.
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from parallel import comm
from parallel.bench.ranks import run_ranks
from parallel.bench.reads import synthetic_samples, write_files
from parallel.bench.shared import Rows, plot
from parallel.bench.timing import load
from parallel.data import BlockDataset, GlobalShuffleSampler, stage, write_manifest
from parallel.data.bandwidth import SharedBandwidth
from parallel.job.family import get, names
from parallel.plan.io import Measure, epoch_time


class SharedFSDataset(BlockDataset):
    """A ``BlockDataset`` whose reads of files under ``shared`` draw from ``storage``."""

    def __init__(self, source: Any, storage: SharedBandwidth, shared: str, **kw: Any) -> None:
        super().__init__(source, **kw)
        self.storage = storage
        self.shared = str(Path(shared).resolve())

    def load(self, key: Any) -> tuple[dict, int, float]:
        sample, nbytes, seconds = super().load(key)
        path, _ = self.locate(key)
        if str(path.resolve()).startswith(self.shared):
            self.storage.draw(nbytes)
        return sample, nbytes, seconds


def measure_of(name: str) -> Measure:
    """``whole``, ``blocks``, ``stage``, ``once``, each optionally ``-<codec>`` (the files it reads)."""
    kind = name.split("-", 1)[0]
    if kind == "whole":
        return Measure(name, whole=True)
    if kind == "stage":
        return Measure(name, staging="each")
    if kind == "once":
        return Measure(name, staging="once")
    if kind == "blocks":
        return Measure(name)
    raise SystemExit(f"wall: unknown measure {name!r} (whole, blocks, stage, once; each may end in -<codec>)")


def codec_of(name: str) -> str:
    return name.split("-", 1)[1] if "-" in name else "none"


def _epoch(ds: SharedFSDataset, sampler: GlobalShuffleSampler, epoch: int, compute_s: float, group: Any) -> None:
    """One epoch: a reader thread two steps ahead, a sleep for the compute, a barrier per step."""
    sampler.set_epoch(epoch)
    steps = list(sampler)

    def read(indices: list[int]) -> list:
        return [ds.load(i) for i in indices]

    with ThreadPoolExecutor(1) as pool:
        ahead = deque(pool.submit(read, steps[k]) for k in range(min(2, len(steps))))
        for k in range(len(steps)):
            ahead.popleft().result()
            if k + 2 < len(steps):
                ahead.append(pool.submit(read, steps[k + 2]))
            time.sleep(compute_s)
            comm.barrier(group, caller="bench.wall step")


def _rank(grid: Any, root: str, ledger: str, rate: float, measures: Sequence[str], compute: float, epochs: int,
          repeat: int, local_size: int) -> list[dict[str, Any]]:
    group = getattr(grid, "cpu_group", None)
    storage = SharedBandwidth(ledger, rate)
    node = grid.rank // local_size
    out = []
    for rep in range(repeat):
        order = list(measures[rep % len(measures):]) + list(measures[:rep % len(measures)])  # interleaved
        for name in order:
            m = measure_of(name)
            src = Path(root) / codec_of(name)
            comm.barrier(group, caller="bench.wall")
            if grid.rank == 0:
                storage.reset()
            comm.barrier(group, caller="bench.wall")
            t0 = time.perf_counter()
            where, staging_s = src, 0.0
            if m.staging:
                dest = Path(root) / "staged" / f"{name}{rep}" / f"node{node}"
                where = stage(src, dest, grid, mode="shard", local_size=local_size, read_once=m.staging == "once",
                              storage=storage).path
                staging_s = time.perf_counter() - t0
            ds = SharedFSDataset(where, storage, str(src), grid=None if m.whole else grid)
            sampler = GlobalShuffleSampler(len(ds), grid, global_batch=grid.data_size, seed=0)
            for e in range(epochs):
                _epoch(ds, sampler, e, compute / grid.spatial_size, group)
            comm.barrier(group, caller="bench.wall")
            total = time.perf_counter() - t0
            ds.close()
            out.append({"measure": name, "repeat": rep, "seconds": total, "staging_s": staging_s,
                        "shared_bytes": storage.total()})
            comm.barrier(group, caller="bench.wall")
            if m.staging and grid.rank % local_size == 0:
                shutil.rmtree(dest, ignore_errors=True)
    return out


def wall_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", default="1,2,4,8", help="rank counts (each a multiple of --spatial, or 1)")
    p.add_argument("--spatial", type=int, default=2, help="ranks per sample (split along D)")
    p.add_argument("--local-size", type=int, default=2, help="ranks per node (consecutive)")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--bandwidth", type=float, default=16e6, help="aggregate shared-storage bytes/s")
    p.add_argument("--compute", type=float, default=0.4, help="compute seconds per sample on one rank")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--measures", default="whole,blocks,blocks-gzip,blocks-lz4,blocks-zstd,blocks-blosc2,stage,once")
    p.add_argument("--dir", type=Path, default=None, help="where the 'shared' files and the staged copies go")


def wall(args: argparse.Namespace) -> Rows:
    """Time per epoch vs ranks at a fixed aggregate storage bandwidth, per way to read."""
    family = get(names()[0])
    measures = args.measures.split(",")
    samples = synthetic_samples(family, args.samples, args.size)
    raw = sum(a.nbytes for s in samples for a in s.values()) / len(samples)
    summary: dict[str, Any] = {"kind": "summary", "command": "wall", "load_before": load(),
                               "bandwidth_Bps": args.bandwidth, "compute_s_per_sample": args.compute,
                               "includes": "epoch_s: (staging + epochs) / epochs, the median of --repeat interleaved "
                                           "runs; predicted: parallel.plan.io from the stored sample size, the "
                                           "bandwidth and the compute per step"}
    tmp = tempfile.TemporaryDirectory(dir=args.dir)
    root = Path(tmp.name)
    stored: dict[str, float] = {}
    for codec in sorted({codec_of(m) for m in measures}):
        (root / codec).mkdir()
        files = write_files(root / codec, family.spec, samples, [(args.spatial, 1, 1)], codec)
        write_manifest(root / codec, family.name)
        stored[codec] = sum(f.stat().st_size for f in files) / len(files)
    del samples
    curves: dict[str, list[tuple[int, float]]] = {m: [] for m in measures}
    try:
        for world in (int(r) for r in args.ranks.split(",")):
            spatial = min(args.spatial, world)
            local = min(args.local_size, world)
            rows = run_ranks(world, _rank, str(root), str(root / "ledger"), args.bandwidth, measures, args.compute,
                             args.epochs, args.repeat, local, spatial=(spatial, 1, 1), timeout=1800)
            for name in measures:
                mine = [r for r in rows[0] if r["measure"] == name]
                seconds = statistics.median(r["seconds"] for r in mine)
                m = measure_of(name)
                sample_bytes = stored[codec_of(name)]
                pred = epoch_time(m, samples=args.samples, sample_bytes=sample_bytes, data=world // spatial,
                                  spatial=spatial, nodes=math.ceil(world / local), fs_bandwidth=args.bandwidth,
                                  compute_step_s=args.compute / spatial, epochs=args.epochs)
                epoch_s = seconds / args.epochs
                curves[name].append((world, epoch_s))
                staging_s = statistics.median(r["staging_s"] for r in mine)
                yield {"kind": "wall", "measure": name, "ranks": world, "data": world // spatial, "spatial": spatial,
                       "nodes": math.ceil(world / local), "epoch_s": epoch_s, "predicted_epoch_s": pred["epoch_s"],
                       "predicted_over_measured": pred["epoch_s"] / epoch_s, "staging_s": staging_s,
                       "steady_epoch_s": (seconds - staging_s) / args.epochs,
                       "predicted_steady_epoch_s": pred["steady_epoch_s"], "predicted_staging_s": pred["staging_s"],
                       "shared_bytes": statistics.median(r["shared_bytes"] for r in mine),
                       "stored_bytes_per_sample": sample_bytes, "raw_bytes_per_sample": raw,
                       "predicted_wait_step_s": pred["wait_step_s"], "epochs": args.epochs}
    finally:
        tmp.cleanup()
    top = max(int(r) for r in args.ranks.split(","))
    at_top = {m: dict(c)[top] for m, c in curves.items() if top in dict(c)}
    if "whole" in at_top:
        best = min(at_top, key=at_top.get)
        summary.update(highest_ranks=top, best_measure=best, best_over_whole=at_top["whole"] / at_top[best],
                       **{f"{m}_epoch_s_at_{top}": v for m, v in at_top.items()})

    def draw(ax: Any) -> None:
        for name, c in curves.items():
            ax.plot([w for w, _ in c], [s for _, s in c], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks")
        ax.set_ylabel("seconds per epoch")
        ax.set_title(f"{args.samples} samples of {args.size}^3 at {args.bandwidth / 1e6:g} MB/s shared")
        ax.legend(fontsize=7)

    summary["plot"] = plot(args, "wall", draw)
    summary["load_after"] = load()
    yield summary
