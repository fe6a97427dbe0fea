"""The same script under plain python, torchrun and mpirun gives the same numbers (those of
the serial maths), and each run matches its serial twin (under srun: tests/test_slurm_real.py)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from parallel.launch import free_port

SELFCHECK = [sys.executable, "-m", "parallel.selfcheck"]
TIMEOUT = 240  # a hung rendezvous fails the test instead of CI


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(var, None)
    return env


def _report(cmd: list[str], env: dict | None = None) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env or _env())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-3000:]}"
    report = json.loads(lines[-1])
    assert report["ok"], report
    return report


def _torchrun(n: int, spatial: str) -> dict:
    return _report([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                    "--master-port", str(free_port()), "-m", "parallel.selfcheck", "--spatial", *spatial.split()])


def _mpirun(n: int, spatial: str) -> dict:
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    assert mpirun, "mpirun not found: install the 'mpi' extra (pip install -e .[mpi])"
    return _report([mpirun, "-n", str(n), *SELFCHECK, "--spatial", *spatial.split()])


def _same(a: dict, b: dict) -> None:
    for key, value in a["checksums"].items():
        assert b["checksums"][key] == pytest.approx(value, rel=1e-5), key


@pytest.fixture(scope="module")
def serial() -> dict:
    """The plain-python self-check, run once for both tests."""
    report = _report(SELFCHECK)
    assert report["launcher"] == "single" and report["world_size"] == 1
    return report


def test_spatial_1x2x2_equals_plain_python_under_torchrun_and_mpirun(serial):
    # under srun (--mpi=none, SLURM_* rendezvous): tests/test_slurm_real.py, on a real Slurm
    runs = {"torchrun": _torchrun(4, "1 2 2"), "mpi": _mpirun(4, "1 2 2")}
    for launcher, report in runs.items():
        assert report["launcher"] == launcher and report["world_size"] == 4 and report["data"] == 1
        _same(serial, report)


def test_data2_x_spatial2_equals_plain_python_under_torchrun_and_mpirun(serial):
    for report in (_torchrun(4, "2 1 1"), _mpirun(4, "2 1 1")):
        assert report["data"] == 2 and report["spatial"] == [2, 1, 1]
        _same(serial, report)
