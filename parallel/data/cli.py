"""Pieces shared by the ``prepare`` commands of the model families.

The commands themselves live with each model family (``python -m <family>.prepare``);
this module gives them the same options for codecs,
splits and workers, the same ``check`` subcommand and the same closing manifest.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from parallel.data.check import check_files
from parallel.data.codecs import codec_kwargs
from parallel.data.format import SampleSpec, parse_splits, write_manifest
from parallel.data.jobs import JobReport, default_workers, mpi

log = logging.getLogger(__name__)


def add_write_args(p: argparse.ArgumentParser) -> None:
    """``--compression``, ``--splits``, ``--workers``: how output files are written."""
    p.add_argument("--compression", "--codec", dest="codec", default="none",
                   help="none, gzip[:level], lz4, zstd[:level], blosc2[:cname[:level]] (bit-shuffle)")
    p.add_argument("--splits", default="2,4,2x2x1,2x2x2",
                   help="spatial splits the chunks must tile, e.g. '2,4,2x2x1' (default %(default)s)")
    p.add_argument("--workers", type=int, default=0,
                   help="processes per rank (default: the cores of this rank)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def write_options(args: argparse.Namespace) -> tuple[str, list[tuple[int, int, int]], int]:
    """Validated (codec, splits, workers) from the parsed options."""
    codec_kwargs(args.codec)  # fail now, not in a worker
    return args.codec, parse_splits(args.splits), args.workers or default_workers()


def finish(out: Path, spec: SampleSpec, report: JobReport, counts: dict[str, int] | None = None,
           **extra: object) -> None:
    """Write the manifest (rank 0, after all ranks finished) and print a summary line.

    ``counts``: samples per output file name, when the command knows them.
    """
    if mpi().rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        write_manifest(out, spec.name, counts=counts, **extra)
        print(json.dumps({"out": str(out), "written": report.run, "skipped": report.skipped,
                          "bytes": report.bytes}))


def add_check(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="open every file and list the bad ones with the reason")
    p.add_argument("dir", type=Path)
    p.add_argument("--quick", action="store_true", help="fields, shapes and dtypes only; read no volumes")
    p.add_argument("--workers", type=int, default=0)


def run_check(args: argparse.Namespace, spec: SampleSpec) -> int:
    """Check ``args.dir`` (and its train/ and val/ when present); 1 if any file is bad."""
    roots = [d for d in (args.dir / "train", args.dir / "val") if d.is_dir()] or [args.dir]
    bad = 0
    total = 0
    for root in roots:
        files = [p for p in root.iterdir() if p.suffix in (".h5", ".hdf5")]
        total += len(files)
        problems = check_files(root, spec, deep=not args.quick,
                               workers=args.workers or default_workers(), progress=sys.stderr.isatty())
        for path, reason in problems:
            print(f"BAD {path}: {reason}")
        bad += len({p for p, _ in problems})
    print(f"checked {total} files: {bad} bad")
    return 1 if bad else 0


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
