"""``scripts/gpu_check.py`` ends a timed-out step's whole process tree.

torchrun starts its workers in sessions of their own; a timeout that killed only torchrun
left them holding the GPUs for the next steps. Here a step starts a worker in its own
session (as torchrun does) and outlasts its timeout: the worker must be gone after.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

WORKER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(120)
"""


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_timed_out_step_ends_workers_in_their_own_sessions(tmp_path):
    gc = _gpu_check()
    check = gc.Check(argparse.Namespace(cpu=True, out=str(tmp_path / "out")))
    pid_file = tmp_path / "worker.pid"
    t0 = time.monotonic()
    result = check.run("launcher", [sys.executable, "-c", WORKER, str(pid_file)], timeout=5)
    assert result.status == "fail" and "timed out after 5 s" in result.data["output"], result.data["output"]
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(worker)
    if alive:
        os.kill(worker, 9)  # leave nothing behind, then fail
    assert not alive, f"the worker {worker} in its own session outlived the step's timeout"
    assert time.monotonic() - t0 < 60
