"""Train what one rank cannot hold, on one machine: a memory budget per rank that the serial
run cannot meet, refused before its first step with the numbers, then ``parallel.spatial=auto``
choosing a split that fits and training a few steps with every rank's measured peak under
the budget, beside the planner's prediction. CosmoFlow on 256^3 samples (4 channels,
batch 1) and the U-Net on 256^3 crops of cases of 256-272 voxels a side, small filter
counts so that a 2-core machine trains a step in seconds.

    python scripts/memory_demo.py                       # 256^3, 4 ranks, 3 steps each (~10 minutes on 2 cores)
    python scripts/memory_demo.py --size 128 --cosmo-budget 600MiB --unet-budget 760MiB   # a quick look (~4 minutes)

Writes data under ``--data`` (once), runs under ``--out``, and prints a markdown table: per
model, the serial refusal (exit status, predicted peak, budget), the split ``auto`` chose,
and each rank's measured peak against the prediction and the budget. Exit 0 when every
check holds (serial refused with exit 2; the split run ended 0; every rank's peak under
the budget and within ``--tolerance`` of the prediction), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


def _run(cmd: list[str], log: Path) -> tuple[int, str, float]:
    """Run ``cmd`` in the repository, its output to ``log``; (status, output, seconds)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout + proc.stderr, encoding="utf-8")
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t


def _prepare(family: str, out: Path, size: int) -> None:
    if (out / "val" / "manifest.json").exists():
        return
    cmd = [sys.executable, "-m", f"{family}.prepare", "synthetic", "--out", str(out), "--size", str(size),
           "--train", "2", "--val", "1", "--quiet", "--workers", "1"]
    if family == "unet3d":  # cases a little larger than the crop, of differing shapes, as real CT cases are
        cmd += ["--size-range", f"{size},{size + size // 16}"]
    rc, text, _ = _run(cmd, out.with_suffix(".prepare.log"))
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({rc}):\n{text[-2000:]}")


def _models(size: int, data: Path) -> dict[str, list[str]]:
    common = ["train.max_steps={steps}", "train.eval_every=0", "train.eval_at_end=false", "data.workers=0",
              "run.progress=false", "run.tensorboard=false", "train.global_batch_size=1"]
    return {
        "cosmoflow": ["--config-name", "quickstart", f"data.dir={data / 'cosmoflow'}", "model.conv_filters=8",
                      "model.n_conv_blocks=5", *common],
        "unet3d": ["--config-name", "quickstart", f"data.dir={data / 'unet3d'}", f"data.crop=[{size},{size},{size}]",
                   "model.depth=3", "model.base_filters=4", "model.max_filters=16", *common],
    }


def demo(family: str, args_: list[str], budget: str, nproc: int, out: Path, tolerance: float) -> tuple[list[str], bool]:
    """One model: the serial refusal, then auto; table rows and whether every check held."""
    rows, ok = [], True
    base = [f"parallel.memory_limit={budget}"]
    rc, text, secs = _run([sys.executable, "-m", f"{family}.train", *args_, *base, "parallel.spatial=[1,1,1]",
                           f"run.dir={out / family / 'serial'}"], out / family / "serial.log")
    m = re.search(r"spatial \[1, 1, 1\] is ([0-9.]+ [MG]iB) .*?over the budget of ([0-9.]+ [MG]iB)", text)
    hint = re.search(r"the smallest split that fits is (parallel.spatial=\[[0-9,]+\])", text)
    ok &= rc == 2 and m is not None
    rows.append(f"| {family} | 1 (serial) | [1,1,1] | exit {rc} in {secs:.0f} s: refused, predicted "
                f"{m.group(1) if m else '?'} > budget {m.group(2) if m else '?'}; smallest that fits: "
                f"{hint.group(1) if hint else '?'} | | |")
    run = out / family / "auto"
    rc, text, secs = _run([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node",
                           str(nproc), "-m", f"{family}.train", *args_, *base, "parallel.spatial=auto",
                           f"run.dir={run}"], out / family / "auto.log")
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else None
    if rc != 0 or summary is None:
        rows.append(f"| {family} | {nproc} | auto | exit {rc}: see {out / family / 'auto.log'} | | |")
        return rows, False
    pred, limit = summary["predicted_peak_memory_bytes"], summary["memory_limit_bytes"]
    peaks = summary["peak_memory_bytes_per_rank"]
    within = all(p <= limit for p in peaks) and all(abs(p / pred - 1) <= tolerance for p in peaks)
    ok &= within
    rows.append(f"| {family} | {nproc} | {summary['grid']['spatial']} (auto) | {summary['steps']} steps in "
                f"{summary['train_seconds']:.0f} s; predicted peak {pred / MIB:.0f} MiB, budget {limit / MIB:.0f} MiB | "
                f"{', '.join(f'{p / MIB:.0f}' for p in peaks)} | "
                f"{', '.join(f'{100 * (p / pred - 1):+.1f}%' for p in peaks)} |")
    return rows, ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=256, help="sample (CosmoFlow) and crop (U-Net) side (default 256)")
    p.add_argument("--nproc", type=int, default=4, help="ranks of the split runs (default 4)")
    p.add_argument("--steps", type=int, default=3, help="training steps of each split run (default 3)")
    p.add_argument("--cosmo-budget", default="1.25GiB", help="CosmoFlow's budget per rank (default %(default)s)")
    p.add_argument("--unet-budget", default="2GiB", help="the U-Net's budget per rank (default %(default)s)")
    p.add_argument("--tolerance", type=float, default=0.15, help="measured peak against predicted (default 0.15)")
    p.add_argument("--data", type=Path, default=REPO / "data" / "memory_demo")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "memory_demo")
    p.add_argument("--only", choices=("cosmoflow", "unet3d"), default=None)
    args = p.parse_args(argv)
    data = args.data / str(args.size)
    budgets = {"cosmoflow": args.cosmo_budget, "unet3d": args.unet_budget}
    rows = ["| model | ranks | split | what happened | measured peak per rank, MiB | against predicted |",
            "| --- | --- | --- | --- | --- | --- |"]
    ok = True
    for family, overrides in _models(args.size, data).items():
        if args.only not in (None, family):
            continue
        _prepare(family, data / family, args.size)
        overrides = [o.replace("{steps}", str(args.steps)) for o in overrides]
        got, good = demo(family, overrides, budgets[family], args.nproc, args.out / str(args.size), args.tolerance)
        rows += got
        ok &= good
    print("\n".join(rows))
    print(f"\nall checks held: {ok} (logs under {args.out / str(args.size)})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
