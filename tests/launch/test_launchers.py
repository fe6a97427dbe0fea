"""The same script under plain python, torchrun and mpirun gives the same numbers (those of
the serial maths), and each run matches its serial twin (under srun: tests/launch/test_slurm_real.py)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from parallel.runtime.launch import free_port

SELFCHECK = [sys.executable, "-m", "parallel.verify.selfcheck"]
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
                    "--master-port", str(free_port()), "-m", "parallel.verify.selfcheck", "--spatial", *spatial.split()])


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


def test_each_launcher_at_4_ranks_equals_plain_python():
    """torchrun on a split in two dims (1x2x2), mpirun on data 2 x spatial 2: each launcher
    once at 4 ranks (the grids' numbers against serial are the matrix's, through the job
    pool; under srun, --mpi=none and pmi2: tests/launch/test_slurm_real.py, on a real Slurm)."""
    serial = _report(SELFCHECK)
    assert serial["launcher"] == "single" and serial["world_size"] == 1
    torchrun = _torchrun(4, "1 2 2")
    assert torchrun["launcher"] == "torchrun" and torchrun["world_size"] == 4 and torchrun["data"] == 1
    assert torchrun["spatial"] == [1, 2, 2]
    mpi = _mpirun(4, "2 1 1")
    assert mpi["launcher"] == "mpi" and mpi["world_size"] == 4
    assert mpi["data"] == 2 and mpi["spatial"] == [2, 1, 1]
    for report in (torchrun, mpi):
        _same(serial, report)
