"""Helpers for the training tests: tiny synthetic sets and launching real training jobs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("RANK", None)
    e.pop("WORLD_SIZE", None)
    return e


def prepare(model: str, out: Path, size: int, train: int, val: int) -> Path:
    """``python -m <model>.prepare synthetic`` into ``out`` (skipped if already there)."""
    if not (out / "val" / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", f"{model}.prepare", "synthetic", "--out", str(out), "--size",
                        str(size), "--train", str(train), "--val", str(val), "--quiet", "--workers", "1"],
                       check=True, env=env(), cwd=REPO, timeout=240, capture_output=True)
    return out


def launch(model: str, nproc: int, overrides: Sequence[str], launcher: str = "torchrun",
           timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``<model>.train`` on ``nproc`` processes (plain python for 1) and check it succeeded."""
    args = ["-m", f"{model}.train", *overrides]
    if nproc == 1:
        cmd = [sys.executable, *args]
    elif launcher == "torchrun":
        cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(nproc), *args]
    else:
        cmd = [str(BIN / "mpirun"), "-n", str(nproc), sys.executable, *args]
    proc = subprocess.run(cmd, env=env(), cwd=REPO, timeout=timeout, capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest max|a - b| / max|a| over the tensors, and its key."""
    assert a.keys() == b.keys()
    worst = (0.0, "")
    for k in a:
        if not a[k].is_floating_point():
            assert torch.equal(a[k], b[k]), k
            continue
        d = ((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-12)).item()
        worst = max(worst, (d, k))
    return worst
