"""``python -m parallel.data stage``: stage a data set to node-local storage as a step of
its own, before the trainings that read it start.

    srun --nodes=N --ntasks-per-node=1 python -m parallel.data stage --read-once SRC DEST
    python -m parallel.data stage SRC DEST          # one node, no launcher

One process per node (``--ranks-per-node`` when a node runs more): the processes meet as
the training's do (``srun``, ``mpirun``, ``torchrun`` or alone; ``parallel.runtime.launch``)
on gloo, and ``parallel.data.staging.stage`` copies whole files (``shard`` mode, every
sample: a global shuffle's need, and any grid's) into DEST. With ``--read-once`` the nodes
split the files, each read once from SRC, and hand each other the rest; every staged file
is checked (size, SHA-256) before the command ends. SRC is a data set root (its
``train/`` and ``val/`` are staged into ``DEST/train`` and ``DEST/val``; ``--split
val=train`` stages ``SRC/train`` into ``DEST/val``, as a config with
``data.val_subdir=train`` does) or one split.
A training with ``data.stage_dir=DEST data.stage_read_once=true data.stage_blocks_only=false``
then finds every file staged and checked and reads nothing from SRC (docs/cluster.md:
``STAGE_ONCE=1`` of a weak-scaling submission).

Prints one JSON line (rank 0): the splits staged, bytes written on all nodes and bytes
read from SRC. Exit status 2 with one line naming the problem for a bad SRC or DEST, 1 when a staged
file fails its check (the file named; it is removed, so staging again fetches it).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Sequence

SPLITS = ("train", "val")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m parallel.data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("stage", help="stage whole files of SRC into node-local DEST (one process per node)")
    p.add_argument("src", type=Path, help="data set root (train/, val/) or one split's directory")
    p.add_argument("dest", type=Path, help="node-local directory (each node its own)")
    p.add_argument("--read-once", action="store_true",
                   help="each file read once per job from SRC, the nodes exchanging over gloo")
    p.add_argument("--split", action="append", default=[], metavar="NAME[=SUBDIR]",
                   help="stage SRC/SUBDIR (default SRC/NAME) into DEST/NAME; repeatable (default: train and "
                        "val, those SRC holds; else SRC itself into DEST)")
    p.add_argument("--ranks-per-node", type=int, default=1,
                   help="consecutive processes per node (default %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any collective may wait (default %(default)s)")
    return parser


def _pairs(src: Path, dest: Path, splits: Sequence[str]) -> list[tuple[str, Path, Path]]:
    """(split, source dir, destination dir): each ``NAME[=SUBDIR]`` of ``splits``; without
    any, train/ and val/ of a root holding them, else src itself."""
    if not src.is_dir():
        raise FileNotFoundError(f"stage: SRC {src} is not a directory")
    if not splits:
        found = [(s, src / s, dest / s) for s in SPLITS if (src / s).is_dir()]
        return found or [("", src, dest)]
    pairs = []
    for item in splits:
        name, _, sub = item.partition("=")
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"stage: --split {item!r}: give NAME or NAME=SUBDIR (NAME a folder name under DEST)")
        if not (src / (sub or name)).is_dir():
            raise FileNotFoundError(f"stage: --split {item}: {src / (sub or name)} is not a directory")
        pairs.append((name, src / (sub or name), dest / name))
    return pairs


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("parallel.data")
    args = _parser().parse_args(argv)
    if args.ranks_per_node < 1:
        log.error("stage: --ranks-per-node %d: give 1 or more", args.ranks_per_node)
        return 2
    try:
        pairs = _pairs(args.src, args.dest, args.split)
    except (FileNotFoundError, ValueError) as err:
        log.error("%s", err)
        return 2
    if args.dest.exists() and not args.dest.is_dir():
        log.error("stage: DEST %s exists and is not a directory", args.dest)
        return 2
    # Here, not at the top: --help and the checks above need no torch.distributed.
    from parallel.data.readonce import StagingCheckError
    from parallel.data.staging import stage
    from parallel.runtime import launch

    grid = launch.init((1, 1, 1), backend="gloo", timeout_s=args.timeout)
    try:
        if grid.world_size % args.ranks_per_node:
            raise ValueError(f"stage: {grid.world_size} processes do not fill nodes of --ranks-per-node "
                             f"{args.ranks_per_node}")
        out = {"nodes": grid.world_size // args.ranks_per_node, "read_once": args.read_once, "splits": {}}
        staged: dict[Path, Path] = {}  # source dir -> where this node staged it
        for name, src, dest in pairs:
            earlier = staged.get(src.resolve())
            if earlier is not None and grid.rank % args.ranks_per_node == 0:
                # A source staged already (data.val_subdir=train): a node-local copy, records
                # included, which the staging below finds held and checks; no second shared read.
                shutil.copytree(earlier, dest, dirs_exist_ok=True)
            staged.setdefault(src.resolve(), dest)
            report = stage(src, dest, grid, mode="shard", local_size=args.ranks_per_node, read_once=args.read_once)
            out["splits"][name or "."] = {"src": str(src), "dest": str(dest), "files": report.files_total,
                                         "bytes_written": report.bytes_total,
                                         "source_bytes": report.source_bytes_total,
                                         "seconds": round(report.seconds_max, 3)}
        if grid.rank == 0:
            out["source_bytes"] = sum(s["source_bytes"] for s in out["splits"].values())
            print("stage: " + json.dumps(out), flush=True)
    except (OSError, ValueError, StagingCheckError) as err:
        log.error("%s", err)
        launch.destroy(sync=False)
        return 1 if isinstance(err, StagingCheckError) else 2
    launch.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
