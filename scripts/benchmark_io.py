"""Compression ratio and block-read throughput per codec, on synthetic CosmoFlow data.

Writes the same synthetic samples once per codec, then reads them as one rank of each
spatial split would (its block, by hyperslab) and whole, and prints one JSON document:
per codec the compression ratio, and per read pattern the bytes read from storage per
sample, seconds per sample, and throughput in MB/s of decoded voxels (and of stored
bytes). Ranks are read one after another in this process: ``rank_seconds`` is one
rank's time per sample, so ``speedup`` (whole-sample seconds / one rank's block seconds)
is what each rank gains when all ranks of a spatial group read at once.

The files were just written, so they are usually in the page cache: this measures
HDF5 and decompression cost, the part a codec adds. To include the storage, point
``--dir`` at the file system of interest and drop the caches between write and read.

    python scripts/benchmark_io.py --size 64 --samples 8 --spatial 2,4,2x2x1
    python scripts/benchmark_io.py --size 128 --samples 4 --codecs none,zstd:1,blosc2:lz4:5
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosmoflow import synthetic  # noqa: E402
from cosmoflow.fields import SPEC  # noqa: E402
from parallel.bench.reads import read_pattern, write_files  # noqa: E402
from parallel.data import parse_splits  # noqa: E402
from parallel.grid import Grid  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--spatial", default="2,4,2x2x1", help="splits to read as (and chunk for)")
    p.add_argument("--codecs", default="none,gzip,lz4,zstd,blosc2")
    p.add_argument("--repeat", type=int, default=2, help="best of this many passes")
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    splits = parse_splits(args.spatial)
    samples = [dict(zip(("volume", "target"), synthetic.sample(args.seed, 0, i, args.size)))
               for i in range(args.samples)]
    raw = sum(a.nbytes for s in samples for a in s.values())
    tmp = tempfile.TemporaryDirectory() if args.dir is None else None
    root = Path(tmp.name) if tmp is not None else args.dir
    report: dict[str, object] = {"size": args.size, "samples": args.samples, "raw_bytes_per_sample": raw / args.samples,
                                 "splits": ["x".join(map(str, s)) for s in splits], "codecs": {}}
    for codec in args.codecs.split(","):
        d = root / codec.replace(":", "_")
        d.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        files = write_files(d, SPEC, samples, splits, codec)
        write_seconds = time.perf_counter() - t0
        stored = sum(f.stat().st_size for f in files)
        whole = read_pattern(files, None, args.repeat)
        entry: dict[str, object] = {"compression_ratio": raw / stored, "file_bytes_per_sample": stored / args.samples,
                                    "write_MBps": raw / write_seconds / 1e6, "whole": whole, "blocks": {}}
        for spatial in splits:
            s = math.prod(spatial)
            ranks = [read_pattern(files, Grid(spatial=spatial, world_size=s, rank=r), args.repeat) for r in range(s)]
            rank_seconds = max(r["seconds_per_sample"] for r in ranks)
            entry["blocks"]["x".join(map(str, spatial))] = {  # type: ignore[index]
                "ranks": s,
                "bytes_read_per_rank_per_sample": max(r["bytes_read_per_sample"] for r in ranks),
                "share_of_whole": max(r["bytes_read_per_sample"] for r in ranks) / whole["bytes_read_per_sample"],
                "rank_seconds": rank_seconds,
                "rank_decoded_MBps": min(r["decoded_MBps"] for r in ranks),
                "group_decoded_MBps": sum(r["decoded_MBps"] for r in ranks),
                "speedup": whole["seconds_per_sample"] / rank_seconds,
            }
        report["codecs"][codec] = entry  # type: ignore[index]
    if tmp is not None:
        tmp.cleanup()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
