"""Prepare 3D U-Net data: synthetic CT-like cases, the KiTS19 converter, checks.

Examples::

    python -m unet3d.prepare synthetic --out data/unet64 --size 64 --train 128 --val 32 --seed 0
    python -m unet3d.prepare synthetic --out data/kits_like --size-range 40,64 --crop 32 --train 64 --val 16
    python -m unet3d.prepare from-kits /data/kits19/preprocessed data/kits --val-list eval_cases.txt
    mpirun -n 4 python -m unet3d.prepare from-kits /data/kits19/preprocessed data/kits
    python -m unet3d.prepare check data/unet64

``synthetic`` writes ``OUT/train`` and ``OUT/val``; ``from-kits`` writes ``OUT/train`` and
``OUT/val`` when given ``--val-list`` (case ids, one per line, e.g. ``case_00003``) or the
source has ``train``/``val`` subdirectories, else ``OUT`` itself. Interrupted runs resume.
``--size-range LO,HI`` draws each synthetic case's sides from [LO, HI] (or
``DLO,DHI,HLO,HHI,WLO,WHI`` per side), as KiTS19's cases differ in shape; ``--crop N`` (or
``D,H,W``) chunks the files for training crops of that size instead of whole-case blocks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from parallel.data.cli import (
    SPLIT_DIRS,
    add_write_args,
    convert_command,
    prepare_main,
    prepare_parser,
    run_split,
    synthetic_command,
    write_options,
)
from parallel.data.jobs import Job
from unet3d import convert
from unet3d.fields import SPEC


def cmd_synthetic(args: argparse.Namespace) -> int:
    codec, splits, _ = write_options(args)
    size = args.size_range if args.size_range is not None else args.size
    for split_id, (name, total) in enumerate((("train", args.train), ("val", args.val))):
        out = args.out / name
        jobs = [Job((out / f"case_{i:05d}.h5",), (out / f"case_{i:05d}.h5", args.seed, split_id, i,
                                                   size, codec, splits, args.crop)) for i in range(total)]
        run_split(convert.write_synthetic, jobs, args, f"synthetic {name}", out, SPEC,
                  {j.outputs[0].name: 1 for j in jobs}, source="synthetic", seed=args.seed, size=size)
    return 0


def cmd_from_kits(args: argparse.Namespace) -> int:
    codec, splits, _ = write_options(args)
    pairs = [(args.src / name, args.out / dest) for name, dest in SPLIT_DIRS.items() if (args.src / name).is_dir()]
    val_ids: set[str] = set()
    if args.val_list is not None:
        val_ids = {line.strip() for line in args.val_list.read_text().splitlines() if line.strip()}
    groups: dict[Path, list[tuple[Path, Path]]] = {}
    for src, out in pairs or [(args.src, args.out)]:
        xs = sorted(src.glob("case_*_x.npy"))
        if not xs:
            raise SystemExit(f"{src}: no case_*_x.npy files")
        for x in xs:
            case = x.name[: -len("_x.npy")]
            y = x.with_name(case + "_y.npy")
            if not y.is_file():
                raise SystemExit(f"{x}: no matching label file {y.name}")
            dest = out
            if not pairs and args.val_list is not None:
                dest = args.out / ("val" if case in val_ids else "train")
            groups.setdefault(dest, []).append((x, y))
    for out, cases in groups.items():
        jobs = []
        for x, y in cases:
            target = out / (x.name[: -len("_x.npy")] + ".h5")
            jobs.append(Job((target,), (x, y, target, codec, splits, args.crop)))
        run_split(convert.convert_kits, jobs, args, f"from-kits {out.name}", out, SPEC,
                  {j.outputs[0].name: 1 for j in jobs}, source=str(args.src))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser, sub = prepare_parser("python -m unet3d.prepare", __doc__)
    p = synthetic_command(sub, "ellipsoid organs with lesions, intensity variation and noise", size=64,
                          train=128, val=32)
    p.add_argument("--size-range", type=convert.parse_size_range, default=None, metavar="LO,HI",
                   help="draw each case's sides from [LO, HI] (or DLO,DHI,HLO,HHI,WLO,WHI); overrides --size")
    p.add_argument("--crop", type=convert.parse_crop, default=None, metavar="N",
                   help="chunk for training crops of N^3 (or D,H,W) instead of whole-case blocks")
    add_write_args(p)
    p = convert_command(sub, "from-kits", "MLPerf preprocessed KiTS19: case_XXXXX_x.npy / _y.npy")
    p.add_argument("--val-list", type=Path, default=None, help="case ids for OUT/val, one per line")
    p.add_argument("--crop", type=convert.parse_crop, default=None, metavar="N",
                   help="chunk for training crops of N^3 (or D,H,W) instead of whole-case blocks (MLPerf: 128)")
    add_write_args(p)
    return prepare_main(parser, sub, SPEC, {"synthetic": cmd_synthetic, "from-kits": cmd_from_kits}, argv)


if __name__ == "__main__":
    sys.exit(main())
