"""Where the ranks of the grid sit on the nodes, and whether that keeps halos intra-node.

The grid numbers ranks spatial-fastest (``rank = data_rank * spatial_size + spatial_rank``),
so the ranks of one spatial group are consecutive. A launcher that places consecutive
ranks on the same node (block distribution: ``torchrun``, ``mpirun -ppn N``,
``srun --distribution=block``) therefore keeps each spatial group, and all of its halo
traffic, on one node whenever the group fits (ranks per node a multiple of the spatial
group size); the data groups, whose only traffic is the gradient all-reduce, span the
nodes. A group larger than a node spans the fewest nodes possible.

``Placement`` checks that from the node of every rank and says it in one log line;
``plan`` computes the placement a block launch will give before anything starts::

    python -m parallel.placement --nodes 2 --ranks-per-node 4 --spatial 2 2 1 --cores-per-node 64

prints the plan, the threads per rank and the launcher flags that give it (the cluster
scripts call it before each launch).

At start-up ``parallel.init`` keeps the ``Placement`` on the grid (``grid.placement``,
``grid.local_rank``, ``grid.local_size``, ``grid.node_count``), built from every rank's
node as ``parallel.runtime.devices.gather_facts`` found it, so nothing after start-up guesses the
layout from launcher variables. This module is the pure model: no process group, no device.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import socket
from dataclasses import dataclass
from typing import Sequence

log = logging.getLogger("parallel")


def node_name() -> str:
    """This process's node: Slurm's name for it when running under Slurm, else the hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def threads_per_rank(cores_per_node: int, ranks_per_node: int) -> int:
    """Cores each rank may use without oversubscribing the node (at least 1)."""
    return max(1, int(cores_per_node) // max(1, int(ranks_per_node)))


@dataclass(frozen=True)
class Placement:
    """The node of every rank (``hosts[rank]``) for a grid whose spatial groups hold
    ``spatial_size`` consecutive ranks."""

    hosts: tuple[str, ...]
    spatial_size: int

    def __post_init__(self) -> None:
        if not self.hosts or len(self.hosts) % self.spatial_size:
            raise ValueError(f"{len(self.hosts)} ranks do not split into spatial groups of {self.spatial_size}")

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    @property
    def nodes(self) -> list[str]:
        """Node names in the order their first rank appears."""
        return list(dict.fromkeys(self.hosts))

    def ranks_on(self, node: str) -> list[int]:
        return [r for r, h in enumerate(self.hosts) if h == node]

    def node_ranks(self, rank: int) -> list[int]:
        """The ranks on ``rank``'s node, ``rank`` included, in order."""
        return self.ranks_on(self.hosts[rank])

    def local_rank(self, rank: int) -> int:
        """``rank``'s position among the ranks of its node."""
        return self.node_ranks(rank).index(rank)

    def local_size(self, rank: int) -> int:
        """How many ranks share ``rank``'s node."""
        return len(self.node_ranks(rank))

    @property
    def node_count(self) -> int:
        return len(self.nodes)

    @property
    def max_ranks_per_node(self) -> int:
        return max(len(self.ranks_on(n)) for n in self.nodes)

    @property
    def spatial_groups(self) -> list[list[int]]:
        s = self.spatial_size
        return [list(range(d * s, (d + 1) * s)) for d in range(self.world_size // s)]

    @property
    def data_groups(self) -> list[list[int]]:
        s = self.spatial_size
        return [list(range(r, self.world_size, s)) for r in range(s)]

    def nodes_of(self, ranks: Sequence[int]) -> list[str]:
        return list(dict.fromkeys(self.hosts[r] for r in ranks))

    @property
    def min_nodes_per_group(self) -> int:
        """The fewest nodes a spatial group can span with this many ranks per node."""
        return math.ceil(self.spatial_size / self.max_ranks_per_node)

    @property
    def split_groups(self) -> list[int]:
        """Data indices of the spatial groups that span more nodes than they need."""
        need = self.min_nodes_per_group
        return [d for d, g in enumerate(self.spatial_groups) if len(self.nodes_of(g)) > need]

    @property
    def block(self) -> bool:
        """Whether every node holds a run of consecutive ranks."""
        return all(r[-1] - r[0] + 1 == len(r) for r in (self.ranks_on(n) for n in self.nodes))

    def warnings(self) -> list[str]:
        out = []
        if self.split_groups:
            out.append(
                f"spatial groups {self.split_groups} span more than {self.min_nodes_per_group} node(s): their "
                f"halo exchanges leave the node. Place consecutive ranks together (srun "
                f"--distribution=block, mpirun -ppn N) with ranks per node a multiple of the spatial "
                f"group size {self.spatial_size}")
        elif not self.block:
            out.append("the ranks of a node are not consecutive (cyclic placement); spatial groups still fit")
        return out

    def describe(self) -> str:
        """One line: nodes, how the spatial and data groups fall on them, rank ranges per node."""
        groups = self.spatial_groups
        local = sum(len(self.nodes_of(g)) == 1 for g in groups)
        data_spans = sorted({len(self.nodes_of(g)) for g in self.data_groups})
        per_node = "; ".join(f"{n}: {_ranges(self.ranks_on(n))}" for n in self.nodes[:8])
        more = f"; ... {len(self.nodes) - 8} more nodes" if len(self.nodes) > 8 else ""
        return (f"placement: {self.world_size} ranks on {len(self.nodes)} node(s), up to "
                f"{self.max_ranks_per_node} per node; {local}/{len(groups)} spatial groups of "
                f"{self.spatial_size} within one node (fewest possible: {self.min_nodes_per_group} "
                f"node(s) each); data groups span {'/'.join(map(str, data_spans))} node(s); "
                f"{per_node}{more}")


def _ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return "ranks " + ",".join(out)


def plan(nodes: int, ranks_per_node: int, spatial: Sequence[int]) -> Placement:
    """The placement a block launch of ``nodes x ranks_per_node`` ranks gives."""
    hosts = tuple(f"node{r // ranks_per_node}" for r in range(nodes * ranks_per_node))
    size = math.prod(int(s) for s in spatial)
    if len(hosts) % size:
        raise ValueError(f"{nodes} node(s) x {ranks_per_node} ranks = {len(hosts)} ranks is not a multiple "
                         f"of the spatial group size {'x'.join(map(str, spatial))} = {size}")
    return Placement(hosts, size)


def log_placement(placement: Placement) -> None:
    """Log (the speaking rank) where the ranks sit; warn when halos leave nodes."""
    log.info("%s", placement.describe())
    for message in placement.warnings():
        log.warning("%s", message)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m parallel.placement",
                                description="Plan a block placement: spatial groups per node, threads per rank.")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--ranks-per-node", type=int, required=True)
    p.add_argument("--spatial", type=int, nargs=3, default=[1, 1, 1], metavar=("SD", "SH", "SW"))
    p.add_argument("--cores-per-node", type=int, default=0, help="cores of a node (0: this machine's)")
    args = p.parse_args(argv)
    try:
        placement = plan(args.nodes, args.ranks_per_node, args.spatial)
    except ValueError as err:
        print(f"error: {err}")
        return 2
    cores = args.cores_per_node or len(os.sched_getaffinity(0))
    print(placement.describe())
    for message in placement.warnings():
        print(f"warning: {message}")
    print(f"threads per rank: {threads_per_rank(cores, args.ranks_per_node)} "
          f"({cores} cores / {args.ranks_per_node} ranks per node)")
    if args.ranks_per_node > cores:
        print(f"warning: {args.ranks_per_node} ranks per node oversubscribe {cores} cores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
