"""Helpers for the training tests: tiny synthetic sets and launching real training jobs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
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


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], floor: float = 1e-2) -> tuple[float, str]:
    """The largest max|a - b| / max(max|a|, floor) over the tensors, and its key.

    The floor: a tensor that is still almost zero (a norm layer's bias after 4 steps, ~1e-5)
    is the difference of O(1) gradient terms, so float32 summation order moves it by
    ~1e-7 absolute; below ``floor`` it is compared at ``rtol * floor`` absolute instead
    (1e-6 at rtol 1e-4, still far below what one misplaced halo voxel does).
    """
    assert a.keys() == b.keys()
    worst = (0.0, "")
    for k in a:
        if not a[k].is_floating_point():
            assert torch.equal(a[k], b[k]), k
            continue
        d = ((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=floor)).item()
        worst = max(worst, (d, k))
    return worst


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint file holds, or -1 while it is missing or half written."""
    try:
        return int(torch.load(path, weights_only=True)["step"])
    except (FileNotFoundError, RuntimeError, EOFError, KeyError):
        return -1


def kill_after_checkpoint(model: str, overrides: Sequence[str], run_dir: Path, step: int) -> int:
    """Train in one process and ``kill -9`` it once ``run_dir``'s last checkpoint holds
    ``step`` or later; returns the step the checkpoint holds after the kill."""
    ckpt = run_dir / "checkpoints" / "last.pt"
    proc = subprocess.Popen([sys.executable, "-m", f"{model}.train", *overrides, f"run.dir={run_dir}"], env=env(),
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while checkpoint_step(ckpt) < step and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    return checkpoint_step(ckpt)
