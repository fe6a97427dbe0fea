"""No hangs: one rank killed (kill -9) or failing stops every rank, naming the rank.

Real jobs of 4 ranks under torchrun and under mpirun (MPICH hydra); one rank is killed
mid-training with SIGKILL. Every process must exit within ``parallel.timeout_s``, the
launcher must exit non-zero, and its output must name the killed rank. A rank that fails
on its own (a corrupt compressed chunk only it reads) must stop the others too, under
mpirun, which does not stop the other ranks when one exits with an error.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from train_helpers import BIN, REPO, env, prepare

TIMEOUT_S = 30  # parallel.timeout_s of these jobs; a loaded 2-core machine needs the margin
TINY = ["--config-name", "quickstart", "train.global_batch_size=4", "model.conv_filters=4", "model.n_conv_blocks=2",
        "model.dense_sizes=[16]", "model.dropout=0.0", "run.progress=false", "run.tensorboard=false", "run.log_every=1",
        "run.log_rank=-3", "data.workers=0", "train.eval_every=0", "train.eval_at_end=false",
        f"parallel.timeout_s={TIMEOUT_S}", "parallel.heartbeat_s=0.5"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """16 training samples of 16^3, gzip-compressed, chunked for a depth split in two."""
    return prepare("cosmoflow", tmp_path_factory.mktemp("cosmo16gz"), 16, 16, 4, "--compression", "gzip",
                   "--splits", "2")


def _command(launcher: str, nproc: int, overrides: list[str]) -> list[str]:
    args = ["-m", "cosmoflow.train", *TINY, *overrides]
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(nproc), *args]
    return [str(BIN / "mpirun"), "-n", str(nproc), sys.executable, *args]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _monitors_of(victim: int, limit: float) -> list[str]:
    """Death monitors watching ``victim`` still alive after up to ``limit`` seconds (a
    monitor outlives the launcher by its note-writing pause and its clean-up)."""
    deadline = time.monotonic() + limit
    while True:
        found = subprocess.run(["pgrep", "-f", "parallel/runtime/monitor.py"], capture_output=True, text=True).stdout.split()
        left = []
        for p in found:
            try:
                if _alive(int(p)) and str(victim) in Path(f"/proc/{p}/cmdline").read_text():
                    left.append(p)
            except OSError:  # ended between pgrep and the read
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _still_running(ranks: list[dict], limit: float) -> list[dict]:
    """The ranks whose processes are still alive after up to ``limit`` seconds (the
    launcher may return while the kernel is still tearing its children down)."""
    deadline = time.monotonic() + limit
    while True:
        left = [r for r in ranks if _alive(r["pid"])]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _wait_for(predicate, proc: subprocess.Popen, limit: float) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"the job ended early ({proc.returncode}):\n{out[-4000:]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("the job made no progress in time")
        time.sleep(0.05)


def _train_rows(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_kill_one_of_four_ranks_stops_the_job(data, tmp_path, launcher):
    run = tmp_path / "run"
    cmd = _command(launcher, 4, [f"data.dir={data}", "parallel.spatial=[2,2,1]", "train.epochs=10000",
                                 f"run.dir={run}"])
    proc = subprocess.Popen(cmd, env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        _wait_for(lambda: _train_rows(run) >= 2 and (run / "ranks.json").exists(), proc, 180)
        ranks = json.loads((run / "ranks.json").read_text())
        victim = ranks[2]["pid"]
        os.kill(victim, signal.SIGKILL)  # mid-training: steps follow each other back to back
        killed_at = time.monotonic()
        out, _ = proc.communicate(timeout=TIMEOUT_S + 30)
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode != 0, out[-3000:]
    assert took < TIMEOUT_S, f"the job took {took:.1f} s to stop after the kill"
    left = _still_running(ranks, TIMEOUT_S - took)
    assert not left, f"ranks still running {TIMEOUT_S} s after the kill: {left}"
    ours = re.search(rf"rank 2 (died \(process {victim}|\(process {victim}\) died)", out)
    # The monitor names every rank it saw end at once when it could not run before the
    # launcher's cleanup had killed more (parallel/runtime/monitor.py): the victim must be among them.
    together = re.search(rf"monitor on .*rank 2 \(process {victim}\).* ended at the same moment", out)
    ours = ours or together
    torchruns = re.search(r"rank\s*: 2 \(local_rank: 2\)\s*\n\s*exitcode\s*: -9", out)
    assert ours or torchruns, f"the killed rank is not named:\n{out[-4000:]}"
    assert not _monitors_of(victim, 10.0), "the death monitor of the killed rank's node outlived the job by 10 s"


def _corrupt_chunk(path: Path, depth: int) -> None:
    """Overwrite the middle of the stored (gzip) chunk of sample 0 at ``depth``."""
    with h5py.File(path, "r") as f:
        dset = f["volume"]
        assert dset.compression == "gzip"
        info = dset.id.get_chunk_info_by_coord((0, 0, depth, 0, 0))
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset + info.size // 4)
        fh.write(np.random.default_rng(0).integers(0, 256, info.size // 2, dtype=np.uint8).tobytes())


def test_one_rank_failing_stops_all_under_mpirun(data, tmp_path):
    data = Path(shutil.copytree(data, tmp_path / "gz"))
    bad = sorted((data / "train").glob("*.h5"))[3]
    _corrupt_chunk(bad, 8)  # the second half in depth: only the rank holding D blocks [8, 16) reads it
    run = tmp_path / "run"
    cmd = _command("mpirun", 2, [f"data.dir={data}", "parallel.spatial=[2,1,1]", "train.epochs=50",
                                 f"run.dir={run}"])
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert re.search(rf"rank 1 failed: SampleReadError: {re.escape(str(bad))}: field 'volume'", out), out[-4000:]
    ranks = json.loads((run / "ranks.json").read_text())
    assert not _still_running(ranks, TIMEOUT_S)
    assert time.monotonic() - t0 < 200
