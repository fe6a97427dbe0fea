"""Prepare CosmoFlow data: synthetic universes, converters from existing layouts, checks.

Examples::

    python -m cosmoflow.prepare synthetic --out data/cosmo32 --size 32 --train 256 --val 64 --seed 0
    python -m cosmoflow.prepare synthetic --out data/cosmo128 --size 128 --train 64 --val 16 \\
        --seed 1 --compression blosc2:zstd:5 --splits 2,4,2x2x1
    python -m cosmoflow.prepare from-npy /data/cosmoUniverse_npy data/cosmo_npy
    python -m cosmoflow.prepare from-tfrecord /data/cosmoUniverse_2019_05_4parE_tf data/cosmo_tf
    python -m cosmoflow.prepare from-universe /data/universes data/cosmo_crops --crop 128
    mpirun -n 8 python -m cosmoflow.prepare from-universe /data/universes data/cosmo512 --crop 0
    python -m cosmoflow.prepare check data/cosmo32

Every command writes ``OUT/train`` and ``OUT/val`` (converters: when the source has
``train`` and ``validation``/``val`` subdirectories, else ``OUT`` itself), a
``manifest.json`` per directory, and resumes where an interrupted run stopped. Under
``mpirun`` the ranks share the files; ``--workers`` sets processes per rank.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import h5py

from cosmoflow import convert
from cosmoflow.fields import SPEC
from cosmoflow.tfrecord import TFRecordError
from parallel.data.cli import (
    add_write_args,
    convert_command,
    exit_cleanly,
    prepare_main,
    prepare_parser,
    run_split,
    split_dirs,
    synthetic_command,
    write_options,
)
from parallel.data.jobs import Job


def cmd_synthetic(args: argparse.Namespace) -> int:
    codec, splits, _ = write_options(args)
    for split_id, (name, total) in enumerate((("train", args.train), ("val", args.val))):
        out = args.out / name
        k = args.samples_per_file
        jobs = [Job((out / f"sample_{first:06d}.h5",),
                    (out / f"sample_{first:06d}.h5", args.seed, split_id, first, min(k, total - first),
                     args.size, codec, splits))
                for first in range(0, total, k)]
        counts = {j.outputs[0].name: j.args[4] for j in jobs}
        run_split(convert.write_synthetic, jobs, args, f"synthetic {name}", out, SPEC, counts, source="synthetic",
                  seed=args.seed, size=args.size)
    return 0


def _npy_pairs(src: Path) -> list[tuple[Path, Path]]:
    lst = src / "files_data.lst"
    if lst.is_file():
        data = [src / line.strip() for line in lst.read_text().splitlines() if line.strip()]
    else:
        data = sorted(src.glob("*_data.npy"))
    pairs = []
    for d in data:
        label = d.with_name(d.name[: -len("_data.npy")] + "_label.npy")
        if not label.is_file():
            raise SystemExit(f"{d}: no matching label file {label.name}")
        pairs.append((d, label))
    return pairs


def cmd_from_npy(args: argparse.Namespace) -> int:
    codec, splits, _ = write_options(args)
    for src, out in split_dirs(args.src, args.out):
        pairs = _npy_pairs(src)
        if not pairs:
            raise SystemExit(f"{src}: no *_data.npy files")
        jobs = [Job((out / (d.name[: -len("_data.npy")] + ".h5"),),
                    (d, lbl, out / (d.name[: -len("_data.npy")] + ".h5"), codec, splits)) for d, lbl in pairs]
        run_split(convert.convert_npy, jobs, args, f"from-npy {out.name}", out, SPEC,
                  {j.outputs[0].name: 1 for j in jobs}, source=str(src))
    return 0


def cmd_from_tfrecord(args: argparse.Namespace) -> int:
    codec, splits, _ = write_options(args)
    for src, out in split_dirs(args.src, args.out):
        files = sorted(p for p in src.iterdir() if p.is_file() and re.search(r"\.tfrecords?(\.gz)?$", p.name))
        if not files:
            raise SystemExit(f"{src}: no *.tfrecord files")
        jobs = []
        for p in files:
            target = out / (re.sub(r"\.tfrecords?(\.gz)?$", "", p.name) + ".h5")
            jobs.append(Job((target,), (p, target, codec, splits, args.size)))
        run_split(convert.convert_tfrecord, jobs, args, f"from-tfrecord {out.name}", out, SPEC, source=str(src))
    return 0


def cmd_from_universe(args: argparse.Namespace) -> int:
    codec, splits, _ = write_options(args)
    for src, out in split_dirs(args.src, args.out):
        files = sorted(p for p in src.iterdir() if p.suffix in (".h5", ".hdf5") and p.is_file())
        if not files:
            raise SystemExit(f"{src}: no universe files (*.h5, *.hdf5)")
        jobs = []
        for p in files:
            with h5py.File(p, "r") as f:
                if "full" not in f:
                    raise SystemExit(f"{p}: no dataset 'full' (has {sorted(f.keys())})")
                side = f["full"].shape[0]
            outputs = convert.universe_outputs(p, out, args.crop, side)
            jobs.append(Job(tuple(outputs), (p, out, args.crop, codec, splits)))
        run_split(convert.convert_universe, jobs, args, f"from-universe {out.name}", out, SPEC,
                  {p.name: 1 for j in jobs for p in j.outputs}, source=str(src), crop=args.crop)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser, sub = prepare_parser("python -m cosmoflow.prepare", __doc__)
    p = synthetic_command(sub, "log-normal Poisson universes with 4 recoverable parameters", size=32, train=256,
                          val=64)
    p.add_argument("--samples-per-file", type=int, default=1)
    add_write_args(p)
    add_write_args(convert_command(sub, "from-npy",
                                   "MLPerf NumPy layout: *_data.npy (S,S,S,4) int16 + *_label.npy"))
    p = convert_command(sub, "from-tfrecord", "MLPerf TFRecord layout (gzip or plain), no TensorFlow")
    p.add_argument("--size", type=int, default=0, help="voxels per side (default: from the byte count)")
    add_write_args(p)
    p = convert_command(sub, "from-universe", "raw boxes: HDF5 'full' (N,N,N,4) int16 + 'unitPar'")
    p.add_argument("--crop", type=int, default=128, help="crop side (0: whole boxes)")
    add_write_args(p)
    return prepare_main(parser, sub, SPEC, {"synthetic": cmd_synthetic, "from-npy": cmd_from_npy,
                                            "from-tfrecord": cmd_from_tfrecord, "from-universe": cmd_from_universe},
                        argv)


if __name__ == "__main__":
    sys.exit(exit_cleanly(main, (convert.ConvertError, TFRecordError)))
