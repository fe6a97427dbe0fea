"""A program that uses only the public API exits cleanly, run after run, under torchrun
and mpirun (it used to abort at exit in about one run in three, with messages
still in flight when the group was torn down; ``parallel.destroy()`` now waits for every
rank first). One run per launcher in CI; the 20-run loop is the nightly tier's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from parallel.runtime.launch import free_port
from train_helpers import BIN, REPO, env

PROGRAM = str(Path(__file__).resolve().parents[1] / "support" / "public_api_program.py")


def _run(cmd: list[str]) -> dict:
    proc = subprocess.run(cmd, env=env(), cwd=REPO, timeout=240, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def _command(launcher: str) -> list[str]:
    if launcher == "torchrun":
        cmd = [str(BIN / "torchrun"), "--nproc-per-node", "4", "--master-port", str(free_port()), PROGRAM]
    else:
        mpirun = shutil.which("mpirun", path=str(BIN)) or shutil.which("mpirun")
        assert mpirun, "mpirun not found: pip install -e .[mpi]"
        cmd = [mpirun, "-n", "4", sys.executable, PROGRAM]
    return cmd


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_public_api_program_exits_cleanly(launcher):
    _check(_run(_command(launcher)), launcher)


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_public_api_program_exits_cleanly_20_times(launcher):
    for _ in range(20):
        _check(_run(_command(launcher)), launcher)


def _check(report: dict, launcher: str) -> None:
    assert report["ok"], report
    # what the grid knows about the job, from the placement gathered at start-up
    assert (report["world_size"], report["local_size"], report["node_count"], report["local_rank"]) == (4, 4, 1, 0)
    assert report["launcher"] == ("torchrun" if launcher == "torchrun" else "mpi")
    host, port = report["store_address"]
    assert host and port > 0
