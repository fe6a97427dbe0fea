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

At start-up ``parallel.init`` gathers every rank's node and visible GPUs once
(``gather_facts``), gives each rank its GPU (``plan_devices``: one GPU per rank, or a
clear error) and keeps the ``Placement`` on the grid (``grid.placement``,
``grid.local_rank``, ``grid.local_size``, ``grid.node_count``), so nothing after
start-up guesses the layout from launcher variables.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import socket
from dataclasses import dataclass
from typing import Any, Sequence

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


class PlacementError(ValueError):
    """Ranks that cannot each have a GPU of their own; the message says which and why."""


def pick_device(local_rank: int, local_size: int, n_gpus: int) -> int | None:
    """The GPU index for the rank at ``local_rank`` of ``local_size`` ranks on a node whose
    ranks each see ``n_gpus`` GPUs; None (the CPU) when there are none.

    ``n_gpus >= local_size``: GPU ``local_rank``. One visible GPU per rank (a launcher
    that binds each rank to its own GPU through ``CUDA_VISIBLE_DEVICES``): GPU 0, and
    ``check_gpus`` confirms that the ranks' GPUs differ. More ranks than GPUs otherwise:
    an error, instead of ranks silently sharing a GPU (which NCCL refuses later).
    """
    if n_gpus <= 0:
        return None
    if n_gpus >= local_size:
        return local_rank
    if n_gpus == 1:
        return 0
    raise PlacementError(
        f"{local_size} ranks on this node but only {n_gpus} GPUs visible to each: start at most {n_gpus} "
        f"ranks per node (torchrun --nproc-per-node {n_gpus}, mpirun -ppn {n_gpus}, srun "
        f"--ntasks-per-node {n_gpus}), or bind each rank to its own GPU (CUDA_VISIBLE_DEVICES)")


def local_position(hosts: Sequence[str], rank: int) -> tuple[int, int]:
    """``(local_rank, local_size)``: where ``rank`` stands among the ranks of its node
    (ordered by global rank, as torchrun's LOCAL_RANK and MPI's shared-memory split)."""
    mine = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    return mine.index(rank), len(mine)


def plan_devices(hosts: Sequence[str], gpus: Sequence[Sequence[str]]) -> list[int | None]:
    """The GPU index of every rank (None: CPU) from every rank's node and the ids (UUIDs)
    of the GPUs it sees; raises ``PlacementError`` when ranks would share a GPU.

    Every rank computes this from the same gathered facts, so all raise together.
    """
    picks: list[int | None] = []
    for rank, host in enumerate(hosts):
        local_rank, local_size = local_position(hosts, rank)
        try:
            picks.append(pick_device(local_rank, local_size, len(gpus[rank])))
        except PlacementError as err:
            raise PlacementError(f"node {host} ({_ranges(_on(hosts, host))}): {err}") from None
    check_gpus(hosts, [None if i is None else gpus[r][i] for r, i in enumerate(picks)])
    return picks


def check_gpus(hosts: Sequence[str], chosen: Sequence[str | None]) -> None:
    """Raise ``PlacementError`` if two ranks of a node chose the same GPU (by its id)."""
    seen: dict[tuple[str, str], int] = {}
    for rank, (host, gpu) in enumerate(zip(hosts, chosen)):
        if gpu is None:
            continue
        other = seen.setdefault((host, gpu), rank)
        if other != rank:
            raise PlacementError(
                f"ranks {other} and {rank} on node {host} would share GPU {gpu} "
                f"({len(_on(hosts, host))} ranks on the node): give each rank its own GPU "
                "(fewer ranks per node, or CUDA_VISIBLE_DEVICES set per rank)")


def _on(hosts: Sequence[str], host: str) -> list[int]:
    return [r for r, h in enumerate(hosts) if h == host]


def visible_gpus() -> list[str]:
    """Ids (UUIDs) of the GPUs this process sees, in index order; empty without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def gather_facts(group: Any, with_gpus: bool) -> tuple[list[str], list[list[str]]]:
    """Every rank's node and (``with_gpus``) the ids of the GPUs it sees, all-gathered over
    ``group`` (a CPU group: NCCL cannot talk before each rank has its GPU). JSON bytes,
    no pickling between ranks."""
    from parallel import comm

    mine = json.dumps({"host": node_name(), "gpus": visible_gpus() if with_gpus else []}).encode()
    facts = [json.loads(b) for b in comm.all_gather_bytes(mine, group)]
    return [f["host"] for f in facts], [f["gpus"] for f in facts]


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
