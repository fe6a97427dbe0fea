"""Pieces shared by the ``prepare`` commands of the model families.

The commands themselves live with each model family (``python -m <family>.prepare``);
this module gives them the same parser (``prepare_parser``, ``synthetic_command``,
``convert_command``), the same options for codecs, splits and workers, the same
``check`` subcommand, the same source layout (``split_dirs``), the same way of running a
split's jobs and writing its manifest (``run_split``) and the same ``main``
(``prepare_main``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from parallel.data.check import check_files
from parallel.data.codecs import codec_kwargs
from parallel.data.format import SampleSpec, parse_splits, write_manifest
from parallel.data.jobs import Job, JobReport, default_workers, mpi, run_jobs

log = logging.getLogger(__name__)


# Source subdirectories of converters and the output split each one becomes.
SPLIT_DIRS = {"train": "train", "validation": "val", "val": "val", "valid": "val"}

Command = Callable[[argparse.Namespace], int]


def split_dirs(src: Path, out: Path) -> list[tuple[Path, Path]]:
    """(source dir, output dir) pairs: ``train``/``validation`` subdirs, or src itself."""
    pairs = [(src / name, out / dest) for name, dest in SPLIT_DIRS.items() if (src / name).is_dir()]
    return pairs or [(src, out)]


def prepare_parser(prog: str, description: str | None) -> tuple[argparse.ArgumentParser, Any]:
    """The parser of a ``prepare`` command and its subcommands."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser, parser.add_subparsers(dest="command", required=True)


def synthetic_command(sub: Any, help: str, size: int, train: int, val: int) -> argparse.ArgumentParser:
    """The ``synthetic`` subcommand: ``--out``, ``--size``, ``--train``, ``--val``, ``--seed``
    and the write options (``--size`` is checked to lie in 1..512 by ``prepare_main``)."""
    p = sub.add_parser("synthetic", help=help)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--size", type=int, default=size, help="voxels per side (up to 512)")
    p.add_argument("--train", type=int, default=train)
    p.add_argument("--val", type=int, default=val)
    p.add_argument("--seed", type=int, default=0)
    return p


def convert_command(sub: Any, name: str, help: str) -> argparse.ArgumentParser:
    """A converter subcommand: positional ``src`` and ``out`` (add the write options last)."""
    p = sub.add_parser(name, help=help)
    p.add_argument("src", type=Path)
    p.add_argument("out", type=Path)
    return p


def prepare_main(parser: argparse.ArgumentParser, sub: Any, spec: SampleSpec, commands: Mapping[str, Command],
                 argv: Sequence[str] | None = None) -> int:
    """Add ``check``, parse ``argv`` and run the chosen subcommand; its exit status."""
    setup_logging()
    add_check(sub)
    args = parser.parse_args(argv)
    if args.command == "check":
        return run_check(args, spec)
    if args.command == "synthetic" and not 1 <= args.size <= 512:
        parser.error(f"--size {args.size}: choose 1..512")
    return commands[args.command](args)


def exit_cleanly(main: Callable[[], int], user_errors: tuple[type[BaseException], ...]) -> int:
    """Run a ``prepare`` command's ``main``; a bad input (one of ``user_errors``, whose
    message names the file) ends it with that one line and status 2, not a traceback."""
    try:
        return main()
    except user_errors as err:
        log.error("%s", err)
        return 2


def run_split(fn: Callable[..., int], jobs: Sequence[Job], args: argparse.Namespace, label: str, out: Path,
              spec: SampleSpec, counts: dict[str, int] | None = None, **extra: object) -> JobReport:
    """Run one output directory's jobs (``--workers`` processes per rank, resuming where an
    earlier run stopped), then write its manifest (``finish``)."""
    report = run_jobs(fn, jobs, args.workers or default_workers(), label, not args.quiet)
    finish(out, spec, report, counts, **extra)
    return report


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
