"""A real Slurm for the tests: slurmctld and two slurmd (nodes ``n1`` and ``n2``) on this
machine, configured in a temporary directory, started once per session and stopped by
their process ids at the end.

Debian's packages (``slurmctld slurmd slurm-client``) are installed with ``apt-get`` when
missing (``.ci/run`` installs them first in CI). Authentication is ``auth/none`` with
``cred/none``, so no munged is needed; every daemon runs as this user (root in CI). Both
nodes are ``localhost`` under their own slurmd ports; their names do not resolve, so the
clients' environment carries ``MASTER_ADDR=127.0.0.1`` for the rendezvous (a test of the
fail-fast path takes it away).

When Slurm cannot run here (no apt, not root), the fixture skips, saying why; with
``CI=true`` it fails instead, so CI never passes without having run these tests.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

PACKAGES = ("slurmctld", "slurmd", "slurm-client")
NODES = ("n1", "n2")
START_TIMEOUT = 60.0


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be installed or started on this machine (the message says why)."""


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def ensure_installed() -> None:
    """Install Debian's Slurm packages unless ``slurmctld``, ``slurmd`` and ``sinfo`` are
    present; raise ``SlurmUnavailable`` when that is impossible here."""
    if all(shutil.which(p, path=f"/usr/sbin:/usr/bin:{os.environ.get('PATH', '')}") for p in
           ("slurmctld", "slurmd", "sinfo", "sbatch", "srun")):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable("Slurm is not installed and cannot be: apt-get needs root on a Debian system "
                               f"(uid {os.geteuid()}, apt-get {'found' if shutil.which('apt-get') else 'missing'})")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SlurmUnavailable(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")


class SlurmCluster:
    """slurmctld plus two slurmd on localhost, from a ``slurm.conf`` under ``root``."""

    def __init__(self, root: Path, cpus: int = 2) -> None:
        self.root = Path(root)
        self.cpus = cpus
        self.conf = self.root / "slurm.conf"
        self.pids: dict[str, int] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        ctld, *node_ports = _free_ports(1 + len(NODES))
        self.ctld_port = ctld
        self.node_ports = dict(zip(NODES, node_ports))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_"))}
        self.env.update(SLURM_CONF=str(self.conf), MASTER_ADDR="127.0.0.1",
                        PATH=f"/usr/sbin:/usr/bin:{os.environ.get('PATH', '')}")

    # -- configuration ----------------------------------------------------------------
    def write_conf(self) -> None:
        r = self.root
        for sub in ("state", "spool"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname()
        nodes = "\n".join(
            f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus} Boards=1 "
            f"SocketsPerBoard=1 CoresPerSocket={self.cpus} ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN"
            for n, p in self.node_ports.items())
        self.conf.write_text(f"""\
ClusterName=spatialtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
ReturnToService=2
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd-%n.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
KillWait=3
# never purge finished jobs: sbatch --wait then polls every 2 s (it backs off to 32 s while MinJobAge/2 allows)
MinJobAge=0
InactiveLimit=0
SlurmdTimeout=60
MessageTimeout=20
{nodes}
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
""", encoding="utf-8")

    # -- daemons ----------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / f"{name}.console", "ab")
        proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs[name], self.pids[name] = proc, proc.pid

    def start_controller(self, clear: bool = False) -> None:
        """``slurmctld -D -i`` (``clear``: a fresh state, so job ids start at 1 again)."""
        if clear:
            shutil.rmtree(self.root / "state", ignore_errors=True)
            (self.root / "state").mkdir()
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])

    def start(self) -> "SlurmCluster":
        ensure_installed()
        self.write_conf()
        self.start_controller()
        for n in NODES:
            (self.root / "spool" / n).mkdir(parents=True, exist_ok=True)
            self._spawn(f"slurmd-{n}", ["slurmd", "-D", "-N", n, "-f", str(self.conf)])
        try:
            self.wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_idle(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until ``sinfo`` shows every node idle."""
        deadline = time.monotonic() + timeout
        out = ""
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited with {proc.returncode}: {self.logs(name)}")
            p = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, timeout=20)
            out = p.stdout
            states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
            if all(states.get(n) == "idle" for n in NODES):
                return
            time.sleep(0.2)
        raise SlurmUnavailable(f"nodes not idle within {timeout:g} s: sinfo says {out!r}; "
                               f"{self.logs('slurmctld')}")

    def restart_controller(self, clear: bool = False) -> None:
        """Stop and start slurmctld (``clear``: forget every job; the next id is 1 again)."""
        self._stop_one("slurmctld")
        self.start_controller(clear)
        self.wait_idle()

    def _stop_one(self, name: str, grace: float = 10.0) -> None:
        proc = self.procs.pop(name, None)
        self.pids.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def stop(self) -> list[int]:
        """Stop every daemon this cluster started (slurmd first); their pids."""
        pids = list(self.pids.values())
        for name in [n for n in self.procs if n != "slurmctld"] + ["slurmctld"]:
            self._stop_one(name)
        return pids

    def logs(self, name: str, tail: int = 3000) -> str:
        text = ""
        for path in (self.root / f"{name}.log", self.root / f"{name}.console"):
            if path.is_file():
                text += f"[{path.name}] " + path.read_text(errors="replace")[-tail:]
        return text

    # -- clients ----------------------------------------------------------------------
    def run(self, cmd: list[str], *, check: bool = True, timeout: float = 120, env: dict | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        """A client command (``sinfo``, ``sbatch``, ``srun``, ...) against this cluster; ``env``
        replaces the cluster's environment (build it from ``self.env``)."""
        proc = subprocess.run(cmd, env=self.env if env is None else env, capture_output=True, text=True,
                              timeout=timeout, cwd=cwd)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n"
                                 f"{proc.stderr[-4000:]}")
        return proc

    def job_state(self, job: int | str) -> str:
        """The job's state (``PENDING``, ``RUNNING``, ``COMPLETED``, ``TIMEOUT``, ...)."""
        out = self.run(["scontrol", "-o", "show", "job", str(job)], check=False).stdout
        m = re.search(r"JobState=(\S+)", out)
        return m.group(1) if m else "UNKNOWN"

    def wait_job(self, job: int | str, timeout: float = 180) -> str:
        """Wait until the job has ended; its final state."""
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job_state(job)
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED"):
                return state
            time.sleep(0.3)
        self.run(["scancel", str(job)], check=False)
        raise AssertionError(f"job {job} still {state} after {timeout:g} s")


def alive(pid: int) -> bool:
    """Whether a process with this id exists (and is not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> SlurmCluster:
    """The session's Slurm cluster (skips without Slurm, except in CI, where it fails)."""
    root = Path(tmp_path_factory.mktemp("slurm"))
    cluster = SlurmCluster(root)
    try:
        cluster.start()
    except (SlurmUnavailable, OSError, subprocess.SubprocessError) as err:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must run the real-Slurm tests, but Slurm cannot start: {err}")
        pytest.skip(f"no real Slurm here: {err}")
    yield cluster
    pids = cluster.stop()
    left = [p for p in pids if alive(p)]
    assert not left, f"Slurm daemons still running after the session: {left}"
