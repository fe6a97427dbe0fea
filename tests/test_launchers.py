"""The same script under plain python, torchrun, mpirun and Slurm-style variables gives
the same numbers (those of the serial maths), and each run matches its serial twin."""

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


def _slurm(n: int, spatial: str) -> dict:
    """What srun sets for each task, without a Slurm controller: n real processes."""
    port = str(free_port())
    procs = []
    for rank in range(n):
        env = _env() | {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(n), "SLURM_LOCALID": str(rank),
                        "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "4242", "MASTER_PORT": port}
        procs.append(subprocess.Popen([*SELFCHECK, "--spatial", *spatial.split()], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT)
            assert p.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for p in procs:
            p.kill()
    return json.loads([line for line in outs[0].splitlines() if line.startswith("{")][-1])


def _same(a: dict, b: dict) -> None:
    for key, value in a["checksums"].items():
        assert b["checksums"][key] == pytest.approx(value, rel=1e-5), key


@pytest.fixture(scope="module")
def serial() -> dict:
    """The plain-python self-check, run once for both tests."""
    report = _report(SELFCHECK)
    assert report["launcher"] == "single" and report["world_size"] == 1
    return report


def test_spatial_1x2x2_equals_plain_python_under_torchrun_mpirun_and_slurm(serial):
    runs = {"torchrun": _torchrun(4, "1 2 2"), "mpi": _mpirun(4, "1 2 2"), "slurm": _slurm(4, "1 2 2")}
    for launcher, report in runs.items():
        assert report["launcher"] == launcher and report["world_size"] == 4 and report["data"] == 1
        _same(serial, report)


def test_data2_x_spatial2_equals_plain_python_under_torchrun_and_mpirun(serial):
    for report in (_torchrun(4, "2 1 1"), _mpirun(4, "2 1 1")):
        assert report["data"] == 2 and report["spatial"] == [2, 1, 1]
        _same(serial, report)
