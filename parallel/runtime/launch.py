"""Start torch.distributed from whatever launched this process, with no flags.

Recognised, in this order:

- already initialised (a caller set up the process group itself);
- ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``);
- ``mpirun``/``mpiexec`` (MPICH, Open MPI, or srun with a PMI the MPI speaks, such as
  ``--mpi=pmi2``): rank and size from mpi4py; rank 0 picks a free port and broadcasts
  ``host:port`` (under srun only when MPI's world is srun's: ``detect_launcher``);
- ``srun`` without MPI (``SLURM_PROCID``, ``SLURM_NTASKS``): the first host of
  ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``) and a port derived from
  ``SLURM_JOB_ID`` (``MASTER_PORT`` wins); a host that does not resolve stops the start at
  once, naming it;
- plain ``python``: a world of one.

NCCL when CUDA is present, gloo otherwise. Every rank's node (and, under NCCL, the GPUs
it sees) is gathered once over a CPU group; each rank gets its own GPU, or a clear error
when a node has more ranks than GPUs; the placement stays on the grid.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from parallel import comm
from parallel.grid import Grid

log = logging.getLogger("parallel")

_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE")
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
NCCL_MARGIN_S = 60.0  # at least this much longer than parallel.timeout_s before NCCL gives up
_STARTS = [0]  # process groups this process has started (each job of a Hydra sweep starts one)


def init_count() -> int:
    """How many process groups this process has started so far (the same on every rank
    of a job that runs the same sequence, such as the jobs of a sweep under torchrun)."""
    return _STARTS[0]


def free_port(host: str = "") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def mpi_world_size(env: dict[str, str]) -> int | None:
    """The size of the MPI world the launcher's variables announce (``PMI_SIZE``, Open
    MPI's ``OMPI_COMM_WORLD_SIZE``, ...), or None when none does (Slurm's PMIx plugin
    sets ``PMIX_RANK`` but no size)."""
    for name in _MPI_SIZE_VARS:
        if env.get(name, "").isdigit():
            return int(env[name])
    return None


def detect_launcher(env: dict[str, str] | None = None) -> str:
    """``torchrun``, ``mpi``, ``slurm`` or ``single``, from the environment alone.

    MPI's variables select mpi4py only when MPI's world is the launcher's. Under ``srun``
    (``SLURM_PROCID``, ``SLURM_NTASKS`` > 1) Slurm's MPI plugin sets ``PMI_RANK`` or
    ``PMIX_RANK`` whether or not the installed MPI speaks that PMI (a plain ``srun`` on a
    cluster whose default is PMIx, with the pip MPICH, which does not): MPI is used only
    when the variables announce a world of ``SLURM_NTASKS`` ranks (``--mpi=pmi2``); when
    they announce none, or one rank, the Slurm path starts the job from ``SLURM_*``. A
    world of several ranks that differs from ``SLURM_NTASKS`` is an MPI launcher's own
    inside an allocation (``mpirun`` in a batch script): MPI.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        return "torchrun"
    slurm_tasks = int(env["SLURM_NTASKS"]) if "SLURM_PROCID" in env and env.get("SLURM_NTASKS", "").isdigit() else 0
    if any(v in env for v in _MPI_RANK_VARS) or "OMPI_COMM_WORLD_SIZE" in env:
        mpi_size = mpi_world_size(env)
        if slurm_tasks > 1 and (mpi_size is None or mpi_size <= 1):
            return "slurm"  # MPI would not see srun's world: Slurm's variables do
        return "mpi"
    if slurm_tasks > 1:
        return "slurm"
    return "single"


class RendezvousError(RuntimeError):
    """The rendezvous host cannot be reached by name (the message names it and its source)."""


def check_rendezvous_host(host: str, source: str) -> None:
    """Fail at once, naming ``host`` and where it came from, when it does not resolve:
    otherwise every rank retries the connection until the process group's timeout."""
    try:
        socket.getaddrinfo(host, None)
    except OSError as err:
        raise RendezvousError(f"the rendezvous host {host!r} ({source}) does not resolve on "
                              f"{socket.gethostname()}: {err}; set MASTER_ADDR to an address every node "
                              f"can reach (docs/cluster.md)") from None


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


def _mpi_rendezvous() -> tuple[int, int, str]:
    """Rank, size and ``tcp://host:port`` from MPI (no pickle: raw bytes)."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    buf = np.zeros(256, dtype=np.uint8)
    if rank == 0:
        host = os.environ.get("MASTER_ADDR") or socket.gethostname()
        port = int(os.environ.get("MASTER_PORT") or free_port())
        raw = f"{host}:{port}".encode()
        buf[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    comm.Bcast(buf, root=0)
    address = bytes(buf[buf != 0]).decode()
    return rank, size, f"tcp://{address}"


def process_group_timeout(backend: str, timeout_s: float) -> float:
    """Seconds the process group lets a collective wait, for ``parallel.timeout_s``.

    Gloo raises in the waiting call after the timeout, and the caller reports it: it
    keeps ``timeout_s``. Under NCCL a timed-out collective is caught by PyTorch's NCCL
    watchdog thread, which aborts the process with its own message
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING``'s default); the project's watchdog declares a
    silent peer after ``timeout_s`` and stops every rank with the project's message, so
    NCCL gets a margin above it (``NCCL_MARGIN_S``, or a tenth of ``timeout_s`` if more).
    """
    if timeout_s <= 0:
        raise ValueError(f"parallel.timeout_s must be positive, got {timeout_s}")
    if "nccl" in backend:
        return timeout_s + max(NCCL_MARGIN_S, 0.1 * timeout_s)
    return timeout_s


def configure_cuda(tf32: bool = False, cudnn_benchmark: bool = True) -> None:
    """Set the process-wide CUDA maths: TF32 for float32 convolutions and matmuls (off by
    default: split and serial convolutions then round alike, about 1e-6 relative in
    float32, instead of about 1e-3 with TF32) and cuDNN's autotuner (on: fixed shapes
    pick the fastest kernel once; the choice may differ between runs, the numbers only
    by float32 rounding). Harmless without CUDA."""
    # The legacy flags on purpose: torch >= 2.9 refuses to read them after a mix with the
    # new ``fp32_precision`` API, and the flags keep every reader consistent.
    torch.backends.cudnn.allow_tf32 = bool(tf32)
    torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
    torch.backends.cudnn.benchmark = bool(cudnn_benchmark)


def _env_int(names: Sequence[str], default: int = 0) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return default


def env_rank() -> int:
    """This process's rank in the job as the launcher's variables tell it, before ``init``
    (torchrun, MPI, srun; 0 for a plain process): who writes shared files and logs early."""
    return _env_int(("RANK", *_MPI_RANK_VARS, "SLURM_PROCID"))


def init(spatial: Sequence[int] | Callable[[Any], Sequence[int]] = (1, 1, 1), *, backend: str | None = None,
         timeout_s: float = 600.0, tf32: bool = False, cudnn_benchmark: bool = True) -> Grid:
    """Start torch.distributed for this process and return its ``Grid``.

    ``spatial`` splits each sample's D, H and W; the data axis takes
    ``world / (sd * sh * sw)`` ranks. It may be a function (``parallel.spatial=auto``):
    rank 0 calls it once the process group runs, with the world's ``Placement`` (ranks,
    nodes, ranks per node), and every rank uses its answer.

    ``backend``: None picks NCCL when CUDA is present (the grid's device is then this
    rank's GPU) and gloo otherwise (the CPU; gloo keeps the model on the CPU even where
    GPUs exist). ``timeout_s`` bounds every collective, so a dead peer ends the job
    instead of hanging it (NCCL gets a margin, ``process_group_timeout``). ``tf32`` and
    ``cudnn_benchmark``: see ``configure_cuda`` (TF32 off: the split equals serial to
    float32 rounding).
    """
    # Here, not at the top: `python -m parallel.placement` must not find itself imported already.
    from parallel.placement import Placement, log_placement
    from parallel.runtime.devices import PlacementError, gather_facts, local_position, plan_devices

    launcher = "external" if dist.is_initialized() else detect_launcher()
    configure_cuda(tf32, cudnn_benchmark)
    if backend is None:
        backend = str(dist.get_backend()) if launcher == "external" else \
            ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = timedelta(seconds=process_group_timeout(backend, timeout_s))
    store: tuple[str, int] | None = None
    if launcher == "torchrun":
        if _STARTS[0] == 0 and _restart() == 0:
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        else:  # a later job of a sweep, or a restart by torchrun's agent: its store still holds earlier groups' keys
            dist.init_process_group(backend, store=_env_store(timeout), rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        store = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    elif launcher == "mpi":
        rank, size, address = _mpi_rendezvous()
        dist.init_process_group(backend, init_method=address, rank=rank, world_size=size, timeout=timeout)
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        store = (host, int(port))
    elif launcher == "slurm":
        # The step's first node, not the job's: concurrent steps (weak scaling) each rendezvous on their own.
        nodelist_var = "SLURM_STEP_NODELIST" if os.environ.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
        if os.environ.get("MASTER_ADDR"):
            host, source = os.environ["MASTER_ADDR"], "MASTER_ADDR"
        else:
            host = first_slurm_host(os.environ[nodelist_var])
            source = f"the first node of {nodelist_var}={os.environ[nodelist_var]}"
        check_rendezvous_host(host, source)
        port = int(os.environ.get("MASTER_PORT") or 20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000)
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}",
                                rank=int(os.environ["SLURM_PROCID"]),
                                world_size=int(os.environ["SLURM_NTASKS"]), timeout=timeout)
        store = (host, port)
    elif launcher == "single":
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}",
                                rank=0, world_size=1, timeout=timeout)
    _STARTS[0] += 1
    nccl = "nccl" in backend
    if nccl:
        log.info("NCCL collectives time out after %.0f s: parallel.timeout_s=%g plus a margin, so the "
                 "watchdog names a silent peer before NCCL's own watchdog aborts (docs/failures.md)",
                 timeout.total_seconds(), timeout_s)
    # A CPU group beside NCCL, for host-side facts: NCCL cannot talk before each rank has its
    # GPU, and the placement decides which GPU that is. Under gloo the world is that group.
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if nccl else dist.group.WORLD
    try:
        hosts, gpus = gather_facts(cpu_group, with_gpus=nccl)
        rank = dist.get_rank()
        local_rank, _ = local_position(hosts, rank)
        device = torch.device("cpu")
        if nccl:
            picks = plan_devices(hosts, gpus)  # the same answer (or error) on every rank
            blind = [r for r, index in enumerate(picks) if index is None]
            if blind:
                raise PlacementError(f"backend {backend} needs a GPU for every rank; ranks {blind} (on "
                                     f"{', '.join(sorted({hosts[r] for r in blind}))}) see none")
            device = torch.device("cuda", picks[rank])
            torch.cuda.set_device(device)
            # The first NCCL operation, with every rank: NCCL starts here (an error surfaces at
            # start-up), and batched point-to-point on the world may later involve only some ranks.
            comm.barrier(None)
        if callable(spatial):
            world = Placement(tuple(hosts), 1)
            spatial = _decided_on_rank0(lambda: spatial(world), cpu_group)  # type: ignore[misc]
        grid = Grid.from_world(spatial, device=device, local_rank=local_rank, launcher=launcher, timeout=timeout)
    except BaseException:
        # Every rank fails here alike (the facts are shared): leave together, not mid-message.
        _leave(cpu_group, min(timeout_s, 60.0))
        raise
    grid.placement = Placement(tuple(hosts), grid.spatial_size)
    grid.store_address, grid.cpu_group, grid.backend = store, cpu_group, backend
    log.info("%s, backend %s", grid.describe(), backend)
    log_placement(grid.placement)  # which node holds which ranks; warns when a spatial group spans nodes
    return grid


def _env_store(timeout: timedelta) -> Any:
    """The rendezvous store of a second or later process group under torchrun's variables,
    or of a group restarted by torchrun's agent (whose store outlives the workers, with
    the dead ones' addresses in it), under a prefix of its own
    (``spatialcnn/restart<r>/start<k>``), so that no key of an earlier group is read.
    torchrun's agent serves the store for the whole run; without the agent (variables set
    by hand) rank 0 serves a new one."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    rank = int(os.environ["RANK"])
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                         is_master=(rank == 0 and not agent), timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore(f"spatialcnn/restart{_restart()}/start{_STARTS[0]}", base)


def _restart() -> int:
    """torchrun's ``TORCHELASTIC_RESTART_COUNT`` (0 at the first start and without torchrun)."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def _decided_on_rank0(decide: Callable[[], Sequence[int]], group: Any) -> tuple[int, int, int]:
    """``decide()`` on rank 0, broadcast over ``group`` (a CPU group of the world): every
    rank builds the same grid (its groups must match) even where ranks would measure or
    read differently. A failure on rank 0 is reported on every rank instead of leaving
    them waiting."""
    choice = torch.full((3,), -1, dtype=torch.int64)
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            choice = torch.tensor([int(v) for v in decide()], dtype=torch.int64)
        except BaseException as exc:  # noqa: BLE001 - the others must hear of it
            error = exc
    comm.broadcast_(choice, 0, group)
    if error is not None:
        raise error
    if bool((choice < 1).any()):
        raise ValueError("rank 0 could not choose the spatial split (see its log)")
    return tuple(int(v) for v in choice.tolist())  # type: ignore[return-value]


def _leave(group: Any, timeout_s: float) -> None:
    """Wait (bounded) for the others of ``group``, then tear the process group down."""
    try:
        comm.barrier(group, timeout_s=timeout_s, caller="parallel.init (failed)")
    except (TimeoutError, RuntimeError) as err:
        log.warning("%s", err)
    dist.destroy_process_group()


def destroy(timeout_s: float = 600.0, *, sync: bool = True) -> None:
    """Tear down the process group (safe to call when none is running).

    With ``sync`` (the default), first wait for this rank's GPU work and for every rank
    to arrive (a barrier on the world group, bounded by ``timeout_s``), so no message of
    the last collectives is still in flight when the group goes: a program that ends
    with ``parallel.destroy()`` exits cleanly. A rank that does not arrive in time is
    logged and the group is torn down anyway. ``sync=False`` skips the wait (an error
    path where the other ranks will not call ``destroy``).
    """
    if not dist.is_initialized():
        return
    if sync:
        if "nccl" in comm.group_backend(None):
            torch.cuda.synchronize()
        try:
            comm.barrier(None, timeout_s=timeout_s, caller="parallel.destroy")
        except TimeoutError as err:
            log.warning("%s; tearing the process group down anyway", err)
    dist.destroy_process_group()
