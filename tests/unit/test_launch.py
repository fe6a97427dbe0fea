"""Decisions of the launch path that need no cluster: which launcher a process's variables
select (MPI only when its world is the launcher's), the first host of a Slurm node list, a rendezvous host that does not
resolve, staging's synchronisation on the CPU group, the stop signal, and the srun task
wrapper that records each task's status."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallel.runtime.launch import RendezvousError, detect_launcher, first_slurm_host, mpi_world_size
from parallel.train import stopsignal

ROOT = Path(__file__).resolve().parents[2]

SRUN2 = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "n[1-2]"}


@pytest.mark.parametrize("env,expected", [
    # srun with Slurm's PMIx plugin as the default: PMIX_RANK but no size; the pip MPICH does not speak PMIx
    ({**SRUN2, "PMIX_RANK": "1", "PMIX_NAMESPACE": "slurm.pmix.7.0"}, "slurm"),
    # srun --mpi=pmi2: MPI's world is srun's
    ({**SRUN2, "PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "5"}, "mpi"),
    # a PMI that announces a world of one (a singleton MPI) under 2 srun tasks
    ({**SRUN2, "PMI_RANK": "0", "PMI_SIZE": "1"}, "slurm"),
    # mpirun inside a batch script: its own world of 4 beside the batch step's variables
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "PMI_RANK": "3", "PMI_SIZE": "4"}, "mpi"),
    ({"PMIX_RANK": "0"}, "mpi"),  # Open MPI's mpirun without Slurm
    ({**SRUN2}, "slurm"),
], ids=["srun-pmix-default", "srun-pmi2", "srun-singleton-mpi", "mpirun-in-allocation", "mpirun-pmix", "srun"])
def test_mpi_is_chosen_only_when_its_world_is_the_launchers(env, expected):
    assert detect_launcher(env) == expected


def test_mpi_world_size_reads_the_size_variables():
    assert mpi_world_size({"PMI_SIZE": "8"}) == 8 and mpi_world_size({"OMPI_COMM_WORLD_SIZE": "3"}) == 3
    assert mpi_world_size({"PMIX_RANK": "0"}) is None


def test_a_rendezvous_host_that_does_not_resolve_fails_at_once_naming_it(monkeypatch):
    import parallel

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "nosuchnode[3-4].invalid")
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=r"the rendezvous host 'nosuchnode3' \(the first node of "
                                              r"SLURM_STEP_NODELIST=nosuchnode\[3-4\]\.invalid\) does not resolve"):
        parallel.init()
    monkeypatch.setenv("MASTER_ADDR", "also-not-a-host.invalid")
    with pytest.raises(RendezvousError, match=r"'also-not-a-host.invalid' \(MASTER_ADDR\)"):
        parallel.init()
    assert time.monotonic() - t0 < 30


def test_staging_synchronises_on_the_grids_cpu_group():
    """Every collective of staging names the grid's CPU group (gloo beside NCCL), never the
    default group: a node copying slower then waits on the host, not in an NCCL collective."""
    tree = ast.parse((ROOT / "parallel" / "data" / "staging.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and isinstance(n.func.value, ast.Name) and n.func.value.id == "comm"]
    collectives = [c for c in calls if c.func.attr in ("barrier", "all_reduce_", "broadcast_", "all_gather")]
    assert len(collectives) >= 3
    for c in collectives:
        group = c.args[0] if c.func.attr == "barrier" else c.args[1]
        text = ast.unparse(group)
        assert text in ("_cpu_group(grid)", "group"), f"staging.py line {c.lineno}: comm.{c.func.attr} on {text}"
    assert "return getattr(grid, 'cpu_group', None)" in ast.unparse(tree)


def test_stop_signal_names_and_the_request():
    assert stopsignal.signal_number("USR1") == signal.SIGUSR1 == stopsignal.signal_number("sigusr1")
    assert stopsignal.signal_number(str(int(signal.SIGTERM))) == signal.SIGTERM
    with pytest.raises(ValueError, match=r"run.stop_signal='USR9' is not a signal name"):
        stopsignal.signal_number("USR9")
    assert stopsignal.arm(None, None) is None
    before = signal.getsignal(signal.SIGUSR1)
    request = stopsignal.arm("USR1", object())
    try:
        assert not request.due()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert request.due()
    finally:
        request.close()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_srun_task_wrapper_records_status_and_passes_usr1_on(tmp_path):
    wrapper = ROOT / "scripts" / "srun_task.sh"
    env = dict(os.environ, SLURM_PROCID="3", SLURMD_NODENAME="nodeX")
    proc = subprocess.run(["bash", str(wrapper), str(tmp_path / "a"), "bash", "-c", "exit 7"], env=env, timeout=60)
    assert proc.returncode == 7
    _, rank, node, status = (tmp_path / "a" / "task_3").read_text().split()
    assert (rank, node, status) == ("3", "nodeX", "7")
    # SIGUSR1 to the wrapper reaches the command, which started with it ignored and then set a handler
    child = ("import signal, sys, time\n"
             "assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN\n"
             "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(5))\n"
             "open(sys.argv[1], 'w').close()\n"
             "time.sleep(60)\n")
    ready = tmp_path / "ready"
    p = subprocess.Popen(["bash", str(wrapper), str(tmp_path / "b"), sys.executable, "-c", child, str(ready)], env=env)
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGUSR1)
    assert p.wait(60) == 5
    assert (tmp_path / "b" / "task_3").read_text().split()[3] == "5"


@pytest.mark.parametrize("env,expected", [
    ({}, "single"),
    ({"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "torchrun"),
    ({"PMI_RANK": "1", "PMI_SIZE": "4"}, "mpi"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "mpi"),
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "8"}, "slurm"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, "single"),
])
def test_launcher_detection(env, expected):
    assert detect_launcher(env) == expected


@pytest.mark.parametrize("nodelist,host", [("gpu[012-015,020]", "gpu012"), ("cn7,cn9", "cn7"),
                                           ("node[3,5]", "node3"), ("login", "login")])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host
