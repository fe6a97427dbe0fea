"""Hosts with their own addresses on this one machine: network namespaces on a bridge.

``hosts(n)`` builds ``n`` hosts, each a network namespace with its own loopback, one veth
link to a bridge and its own IPv4 address (10.77.0.1, .2, ...), and each command run on a
host also gets its own hostname (a UTS namespace: ``host1``, ``host2``, ...), so that
what the job reports names the host. The bridge sits in a namespace of its own (the
"switch"), so nothing is added to the machine's own network: only the namespace names
(``/run/netns``, made unique with this process's id) are visible outside. Needs root,
``ip`` and ``unshare`` (iproute2, util-linux).

A host's link can be taken down, slowed (``tc tbf``: a rate, drops past a queue) or
delayed and made lossy (``tc netem``, where the kernel has it). Everything is
removed when the ``with`` block ends, also when the test fails: every process still in a
host's namespace is killed first (their ids from ``ip netns pids``), then the namespaces
are deleted, which removes their links and the bridge.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

SUBNET = "10.77.0"
_COUNT = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def available() -> str | None:
    """None if network namespaces can be built here, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    name = f"sc-probe-{os.getpid()}-{next(_COUNT)}"
    try:
        made = _ip("netns", "add", name, check=False)
        if made.returncode != 0:
            return f"ip netns add failed: {made.stderr.strip()}"
        link = _ip("-n", name, "link", "add", "b0", "type", "bridge", check=False)
        if link.returncode != 0:
            return f"cannot make a bridge in a namespace: {link.stderr.strip()}"
        return None
    except (OSError, subprocess.SubprocessError) as err:
        return f"ip is not usable: {err}"
    finally:
        _ip("netns", "del", name, check=False)


@dataclass
class Host:
    """One host: its namespace, hostname, address and link (``eth0`` on every host, as on
    identical nodes: one ``GLOO_SOCKET_IFNAME`` serves every rank)."""

    ns: str
    name: str
    addr: str
    dev: str
    port: str  # the bridge's end of the link, in the switch
    switch: str
    hosts_file: str  # /etc/hosts as every host sees it: each host's name and address

    def command(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` as run on this host: its network, its hostname, and an /etc/hosts that
        resolves every host's name (mount and UTS namespaces of the command's own).
        ``nsenter`` rather than ``ip netns exec``, which mounts a sysfs of its own and so
        hides the cgroup tree (slurmd needs it)."""
        return ["nsenter", f"--net=/run/netns/{self.ns}", "unshare", "--uts", "--mount", "sh", "-c",
                f'hostname {self.name} && mount --bind {self.hosts_file} /etc/hosts && exec "$@"', "sh", *cmd]

    def popen(self, cmd: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``cmd`` on this host, in a new session (so it can be ended as a group)."""
        return subprocess.Popen(self.command(cmd), start_new_session=True, **kwargs)

    def link_down(self) -> None:
        """Cut this host off the bridge (as a pulled cable: nothing is told, packets vanish)."""
        _ip("-n", self.switch, "link", "set", self.port, "down")

    def netem(self, spec: str) -> None:
        """Delay or drop what this host sends: ``tc netem`` arguments, e.g. ``delay 20ms
        loss 1%`` (needs the kernel's ``sch_netem``, which this machine's kernel lacks)."""
        subprocess.run(["tc", "-n", self.ns, "qdisc", "replace", "dev", self.dev, "root", "netem", *spec.split()],
                       check=True, capture_output=True, text=True, timeout=30)

    def slow(self, rate: str, queue: str = "50ms") -> None:
        """Limit what this host sends to ``rate`` (``tc tbf``: e.g. ``1mbit``); packets that
        would wait longer than ``queue`` in its queue are dropped, so TCP retransmits them
        (a slow and lossy link where ``netem`` is missing)."""
        subprocess.run(["tc", "-n", self.ns, "qdisc", "replace", "dev", self.dev, "root", "tbf", "rate", rate,
                        "burst", "16kbit", "latency", queue], check=True, capture_output=True, text=True, timeout=30)

    def sysctl(self, key: str, value: str) -> None:
        """Set a network sysctl of this host (they are per namespace), e.g. how long TCP
        retransmits to a peer that stopped answering (``net.ipv4.tcp_retries2``)."""
        subprocess.run(["ip", "netns", "exec", self.ns, "sysctl", "-q", "-w", f"{key}={value}"], check=True,
                       capture_output=True, text=True, timeout=30)

    def pids(self) -> list[int]:
        """Processes running in this host's network namespace."""
        out = _ip("netns", "pids", self.ns, check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]


SSH_STANDIN = """#!/bin/sh
# ssh's stand-in for mpirun's launcher (-launcher ssh -launcher-exec THIS): hydra calls
# THIS -x HOST "COMMAND"; COMMAND runs on HOST (its namespace, hostname and /etc/hosts)
[ "$1" = "-x" ] && shift
host="$1"; shift
case "$host" in
{cases}
  *) echo "no host $host here" >&2; exit 255 ;;
esac
exec nsenter --net="/run/netns/$ns" unshare --uts --mount sh -c \
  'hostname "$0" && mount --bind {hosts_file} /etc/hosts && exec sh -c "$1"' "$host" "$*"
"""


def ssh_standin(hs: Sequence[Host], folder: str) -> str:
    """A script that mpirun's hydra can use as its ssh (``-launcher ssh -launcher-exec``):
    it starts hydra's proxy on the named host. Its path."""
    cases = "\n".join(f"  {h.name}|{h.addr}) ns={h.ns} ;;" for h in hs)
    path = os.path.join(folder, "ssh")
    with open(path, "w", encoding="utf-8") as f:
        f.write(SSH_STANDIN.format(cases=cases, hosts_file=hs[0].hosts_file))
    os.chmod(path, 0o755)
    return path


def _kill_all(hs: Sequence[Host]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [p for h in hs for p in h.pids()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 5
        while pids and time.monotonic() < deadline and any(h.pids() for h in hs):
            time.sleep(0.1)


@contextlib.contextmanager
def hosts(n: int) -> Iterator[list[Host]]:
    """``n`` hosts on one bridge (see the module docstring), removed afterwards."""
    tag = f"sc{os.getpid()}-{next(_COUNT)}"
    switch = f"{tag}-sw"
    made: list[str] = []
    hs: list[Host] = []
    folder = tempfile.mkdtemp(prefix=f"{tag}-")
    hosts_file = os.path.join(folder, "hosts")
    with open(hosts_file, "w", encoding="utf-8") as f:
        f.write("127.0.0.1 localhost\n" + "".join(f"{SUBNET}.{i + 1} host{i + 1}\n" for i in range(n)))
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i in range(n):
            h = Host(ns=f"{tag}-h{i + 1}", name=f"host{i + 1}", addr=f"{SUBNET}.{i + 1}", dev="eth0",
                     port=f"p{i + 1}", switch=switch, hosts_file=hosts_file)
            _ip("netns", "add", h.ns)
            made.append(h.ns)
            _ip("link", "add", h.dev, "netns", h.ns, "type", "veth", "peer", "name", h.port, "netns", switch)
            _ip("-n", switch, "link", "set", h.port, "master", "br0", "up")
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.dev)
            _ip("-n", h.ns, "link", "set", h.dev, "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
            hs.append(h)
        yield hs
    finally:
        _kill_all(hs)
        for ns in reversed(made):
            _ip("netns", "del", ns, check=False)
        shutil.rmtree(folder, ignore_errors=True)
