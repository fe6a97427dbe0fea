"""Helpers for the training tests: tiny synthetic sets and launching real training jobs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import torch

from jobpool import JobPool

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("RANK", None)
    e.pop("WORLD_SIZE", None)
    return e


POOL: JobPool | None = None
"""The session's pool of rank processes (``tests/conftest.py`` sets it; started on first use)."""
CACHE: Path | None = None
"""The session's folder of generated data sets, shared read-only by every test."""


def pool() -> JobPool:
    global POOL
    if POOL is None:  # a helper used outside pytest's session
        POOL = JobPool()
    return POOL


def prepare(model: str, out: Path, size: int, train: int, val: int, *extra: str) -> Path:
    """``python -m <model>.prepare synthetic`` (seed 0), made once per session and shared.

    The set lives in the session's cache and is READ-ONLY: a test that changes files
    copies it first (``prepare_copy``). ``out`` is where it is made when no cache is set
    (outside pytest's session); with the cache it names nothing. Generated in the job pool.
    """
    key = f"{model}-s{size}-t{train}-v{val}" + "".join(f"-{a.strip('-')}" for a in extra)
    if CACHE is not None:
        out = CACHE / key
    if not (out / "val" / "manifest.json").exists():
        proc = pool().run(f"{model}.prepare", ["synthetic", "--out", str(out), "--size", str(size), "--train",
                                               str(train), "--val", str(val), "--quiet", "--workers", "1", *extra],
                          env=env(), timeout=240)
        if proc.returncode != 0:
            raise AssertionError(f"{model}.prepare exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return out


def prepare_copy(model: str, out: Path, size: int, train: int, val: int, *extra: str) -> Path:
    """A private, writable copy of ``prepare``'s set at ``out`` (for tests that change files)."""
    import shutil

    shutil.copytree(prepare(model, out.with_name(out.name + "_src"), size, train, val, *extra), out)
    return out


def launch(model: str, nproc: int, overrides: Sequence[str], launcher: str = "pool",
           timeout: float = 240, module: str = "train", check: bool = True,
           extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``<model>.<module>`` on ``nproc`` processes and check it succeeded (``check``).

    ``launcher``: ``pool`` (the default) runs the job on the session's rank processes with
    torchrun's variables (``tests/support/jobpool.py``): for tests that prove numbers. ``torchrun``
    and ``mpirun`` start real launchers (plain python for one process): for tests of the
    launch itself.
    """
    args = ["-m", f"{model}.{module}", *overrides]
    e = env()
    e.update(extra_env or {})
    if launcher == "pool":
        proc = pool().run(f"{model}.{module}", list(overrides), nproc=nproc, env=e, timeout=timeout)
        cmd = [f"pool:{nproc}", *args]
    else:
        if nproc == 1:
            cmd = [sys.executable, *args]
        elif launcher == "torchrun":
            cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(nproc), *args]
        else:
            cmd = [str(BIN / "mpirun"), "-n", str(nproc), sys.executable, *args]
        try:
            proc = subprocess.run(cmd, env=e, cwd=REPO, timeout=timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired as err:
            raise AssertionError(f"{' '.join(cmd)} did not end within {timeout:.0f} s") from err
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def python_m(module: str, args: Sequence[str], nproc: int = 1, timeout: float = 240,
             extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m module *args`` (or ``python script.py`` for a path ending in .py) on
    ``nproc`` ranks of the session's job pool, with its output; the caller checks the status."""
    e = env()
    e.update(extra_env or {})
    return pool().run(module, list(args), nproc=nproc, env=e, timeout=timeout)


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


# Runs cosmoflow.train with torch.save writing half of the checkpoint of step >= AT, then
# writing "<step> <thread>" to MARKER and sleeping: kill_during_checkpoint_write kills it there.
_SLOW_SAVE = r"""
import io, runpy, sys, time, threading
import torch
marker, at = sys.argv[1], int(sys.argv[2])
real_save = torch.save
def save(obj, f, *args, **kwargs):
    if isinstance(obj, dict) and int(obj.get("step", 0)) >= at:
        buf = io.BytesIO()
        real_save(obj, buf, *args, **kwargs)
        data = buf.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        open(marker, "w").write(f"{obj['step']} {threading.current_thread().name}")
        time.sleep(600)
    return real_save(obj, f, *args, **kwargs)
torch.save = save
sys.argv = ["cosmoflow.train", *sys.argv[3:]]
runpy.run_module("cosmoflow.train", run_name="__main__")
"""


def kill_during_checkpoint_write(overrides: Sequence[str], at: int, marker: Path, timeout: float = 180) -> str:
    """Train CosmoFlow in one real process and ``kill -9`` it (its process group) in the middle
    of writing the first checkpoint of step ``at`` or later; returns what that write said:
    ``"<step> <thread name>"`` (the thread: the main one, or the background writer's)."""
    import os
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-c", _SLOW_SAVE, str(marker), str(at), *overrides], env=env(),
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), f"no checkpoint write reached ({proc.poll()}): {proc.stderr.read()[-3000:]}"
        time.sleep(0.05)  # the marker's text is written
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    return marker.read_text()

