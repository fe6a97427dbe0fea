"""The real Slurm of ``slurm_cluster.py`` on the namespace hosts of ``netns_hosts.py``:
slurmctld and node ``n1``'s slurmd on host1, node ``n2``'s slurmd on host2, each node's
``NodeAddr`` its host's own address, so that ``srun``'s messages and its job's halo
exchanges cross the link between them. The clients (``sinfo``, ``srun``) run on host1.
The daemons are stopped by their process ids like the one-host cluster's (and whatever is
left on the hosts is killed when ``netns_hosts.hosts`` ends).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Sequence

from netns_hosts import Host
from slurm_cluster import NODES, SlurmCluster


class HostsSlurm(SlurmCluster):
    """``SlurmCluster`` with node ``NODES[i]`` on host ``i`` (see the module docstring)."""

    def __init__(self, root: Path, hosts: Sequence[Host], cpus: int = 2) -> None:
        super().__init__(root, cpus)
        self.hosts = list(hosts)
        self.on = {"slurmctld": self.hosts[0], **{f"slurmd-{n}": h for n, h in zip(NODES, self.hosts)}}
        # the rendezvous on the first node's address; gloo on the hosts' links (eth0 everywhere)
        self.env.update(MASTER_ADDR=self.hosts[0].addr, GLOO_SOCKET_IFNAME="eth0")

    def write_conf(self) -> None:
        super().write_conf()
        text = self.conf.read_text(encoding="utf-8")
        first = self.hosts[0]
        text = re.sub(r"^SlurmctldHost=.*$", f"SlurmctldHost={first.name}({first.addr})", text, flags=re.M)
        for n, h in zip(NODES, self.hosts):
            text = re.sub(rf"^NodeName={n} NodeHostname=\S+ NodeAddr=\S+",
                          f"NodeName={n} NodeHostname={h.name} NodeAddr={h.addr}", text, flags=re.M)
        self.conf.write_text(text, encoding="utf-8")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        super()._spawn(name, self.on[name].command(cmd))

    def run(self, cmd: list[str], *, check: bool = True, timeout: float = 120, env: dict | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        return super().run(self.hosts[0].command(cmd), check=check, timeout=timeout, env=env, cwd=cwd)
