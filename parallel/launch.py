"""Start torch.distributed from whatever launched this process, with no flags.

Recognised, in this order:

- already initialised (a caller set up the process group itself);
- ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``);
- ``mpirun``/``mpiexec`` (MPICH, Open MPI, or srun with PMI/PMIx): rank and size from
  mpi4py; rank 0 picks a free port and broadcasts ``host:port``;
- ``srun`` without MPI (``SLURM_PROCID``, ``SLURM_NTASKS``): the first host of
  ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``) and a port derived from
  ``SLURM_JOB_ID`` (``MASTER_PORT`` wins);
- plain ``python``: a world of one.

NCCL when CUDA is present, gloo otherwise; one device per local rank.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from parallel.grid import Grid

log = logging.getLogger("parallel")

_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE")
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
_STORE_ADDRESS: tuple[str, int] | None = None  # set by init: where the rendezvous store listens


def free_port(host: str = "") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def detect_launcher(env: dict[str, str] | None = None) -> str:
    """``torchrun``, ``mpi``, ``slurm`` or ``single``, from the environment alone."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        return "torchrun"
    if any(v in env for v in _MPI_RANK_VARS) or "OMPI_COMM_WORLD_SIZE" in env:
        return "mpi"
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return "slurm"
    return "single"


def first_slurm_host(nodelist: str) -> str:
    """The first hostname of a Slurm node list such as ``gpu[012-015,020],cpu7``."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot read SLURM_JOB_NODELIST={nodelist!r}")
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _mpi_rendezvous() -> tuple[int, int, int, str]:
    """Rank, size, local rank and ``tcp://host:port`` from MPI (no pickle: raw bytes)."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    local_rank = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    buf = np.zeros(256, dtype=np.uint8)
    if rank == 0:
        host = os.environ.get("MASTER_ADDR") or socket.gethostname()
        port = int(os.environ.get("MASTER_PORT") or free_port())
        raw = f"{host}:{port}".encode()
        buf[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    comm.Bcast(buf, root=0)
    address = bytes(buf[buf != 0]).decode()
    return rank, size, local_rank, f"tcp://{address}"


def store_address() -> tuple[str, int] | None:
    """``(host, port)`` of the job's rendezvous TCPStore (None for a world of one or an
    externally initialised group); the watchdog opens its own connection to it."""
    return _STORE_ADDRESS


def _env_int(names: Sequence[str], default: int = 0) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return default


def env_rank() -> int:
    """This process's rank in the job as the launcher's variables tell it, before ``init``
    (torchrun, MPI, srun; 0 for a plain process): who writes shared files and logs early."""
    return _env_int(("RANK", *_MPI_RANK_VARS, "SLURM_PROCID"))


def init(spatial: Sequence[int] | Callable[[], Sequence[int]] = (1, 1, 1), *, backend: str | None = None,
         timeout_s: float = 600.0) -> Grid:
    """Start torch.distributed for this process and return its ``Grid``.

    ``spatial`` may be a function (``parallel.spatial=auto``): rank 0 calls it once the
    process group runs and every rank uses its answer.

    ``spatial`` splits each sample's D, H and W; the data axis takes
    ``world / (sd * sh * sw)`` ranks. ``timeout_s`` bounds every collective, so a dead
    peer ends the job instead of hanging it.
    """
    global _STORE_ADDRESS
    launcher = "external" if dist.is_initialized() else detect_launcher()
    _STORE_ADDRESS = None
    local_rank = _env_int(_LOCAL_RANK_VARS)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = timedelta(seconds=timeout_s)

    if launcher == "torchrun":
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
        _STORE_ADDRESS = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    elif launcher == "mpi":
        rank, size, local_rank, address = _mpi_rendezvous()
        if device.type == "cuda":
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=address, rank=rank, world_size=size, timeout=timeout)
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        _STORE_ADDRESS = (host, int(port))
    elif launcher == "slurm":
        # The step's first node, not the job's: concurrent steps (weak scaling) each rendezvous on their own.
        host = os.environ.get("MASTER_ADDR") or first_slurm_host(
            os.environ.get("SLURM_STEP_NODELIST") or os.environ["SLURM_JOB_NODELIST"])
        port = int(os.environ.get("MASTER_PORT") or 20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000)
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}",
                                rank=int(os.environ["SLURM_PROCID"]),
                                world_size=int(os.environ["SLURM_NTASKS"]), timeout=timeout)
        _STORE_ADDRESS = (host, port)
    elif launcher == "single":
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}",
                                rank=0, world_size=1, timeout=timeout)

    if callable(spatial):
        spatial = _decided_on_rank0(spatial, device)
    grid = Grid.from_world(spatial, device=device, local_rank=local_rank, launcher=launcher)
    log.info("%s, backend %s", grid.describe(), backend)
    from parallel.placement import log_placement  # here, not above: `python -m parallel.placement` stays clean
    log_placement(grid)  # which node holds which ranks; warns when a spatial group spans nodes
    return grid


def _decided_on_rank0(decide: Callable[[], Sequence[int]], device: torch.device) -> tuple[int, int, int]:
    """``decide()`` on rank 0, broadcast to all: every rank builds the same grid (its groups
    must match) even where ranks would measure or read differently. A failure on rank 0
    is reported on every rank instead of leaving them waiting."""
    choice = torch.full((3,), -1, dtype=torch.int64)
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            choice = torch.tensor([int(v) for v in decide()], dtype=torch.int64)
        except BaseException as exc:  # noqa: BLE001 - the others must hear of it
            error = exc
    if dist.get_world_size() > 1:
        on = choice.to(device) if dist.get_backend() == "nccl" else choice
        dist.broadcast(on, src=0)
        choice = on.cpu()
    if error is not None:
        raise error
    if bool((choice < 1).any()):
        raise ValueError("rank 0 could not choose the spatial split (see its log)")
    return tuple(int(v) for v in choice.tolist())  # type: ignore[return-value]


def destroy() -> None:
    """Tear down the process group (safe to call when none is running)."""
    if dist.is_initialized():
        dist.destroy_process_group()
