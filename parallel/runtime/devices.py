"""Each rank's device, chosen once at start-up from facts every rank gathers.

``parallel.init`` gathers every rank's node and visible GPUs once (``gather_facts``, over
a CPU group: NCCL cannot talk before each rank has its GPU) and gives each rank its GPU
(``plan_devices``: one GPU per rank, or a clear ``PlacementError`` raised alike on every
rank). Where the ranks sit on the nodes is ``parallel.placement``'s.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from parallel import comm
from parallel.placement import _ranges, node_name


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
    mine = json.dumps({"host": node_name(), "gpus": visible_gpus() if with_gpus else []}).encode()
    facts = [json.loads(b) for b in comm.all_gather_bytes(mine, group)]
    return [f["host"] for f in facts], [f["gpus"] for f in facts]
