"""Run a function on ``world`` spawned gloo ranks (one thread each) and collect results.

For benchmarks and calibration, not tests (``tests/support/harness.py`` keeps pools alive across
cases): a fresh set of ranks per call, so each measurement starts from a clean process
(peak memory, caches). A failing rank fails the call with its traceback.

The ranks are forked from a fork server that imported torch once (``multiprocessing``'s
``forkserver`` context, torch and ``torch._dynamo`` preloaded, no thread pool, CUDA or
process group started in it): each call's processes are new, but they skip the ~2.5 CPU
seconds every fresh interpreter spends importing torch, which a benchmark of several grids
would pay again per grid. Memory measurements (``start="spawn"``: a forked rank's resident
set would begin with the server's) and GPU ranks start from a fresh interpreter, as every
rank does with ``SPATIALCNN_BENCH_START=spawn``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Sequence

from parallel.runtime.launch import free_port


def _worker(rank: int, world: int, port: int, threads: int, fn: Callable[..., Any], args: tuple,
            spatial: Sequence[int], results: Any, device: str = "cpu") -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch
    import torch.distributed as dist

    from parallel import comm
    from parallel.grid import Grid

    torch.set_num_threads(threads)
    try:
        where = torch.device("cpu")
        if device == "cuda":  # one GPU per rank, NCCL, TF32 off (the framework's defaults)
            from parallel.runtime.launch import configure_cuda

            where = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(where)
            configure_cuda(tf32=False)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world, timeout=timedelta(seconds=600))
        comm.barrier(None)  # a first operation of every rank (NCCL's rule for point-to-point)
        grid = Grid.from_world(spatial, device=where)
        results.put((rank, True, fn(grid, *args)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))


_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "parallel.comm", "parallel.grid"]


def _context(start: str) -> Any:
    """The fork server with torch imported (once per process), or ``spawn`` where asked or
    where there is no fork server (Windows)."""
    if os.environ.get("SPATIALCNN_BENCH_START", "forkserver") not in ("forkserver", "spawn"):
        raise ValueError(f"SPATIALCNN_BENCH_START={os.environ['SPATIALCNN_BENCH_START']!r}: expected forkserver "
                         "or spawn")
    if os.environ.get("SPATIALCNN_BENCH_START") == "spawn":
        start = "spawn"
    if start == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, spatial: Sequence[int] = (1, 1, 1),
              threads: int = 1, timeout: float = 600.0, device: str = "cpu", start: str = "forkserver") -> list[Any]:
    """``fn(grid, *args)`` on every rank of a fresh ``world``; results in rank order.
    ``device="cuda"``: one GPU per rank over NCCL (the world may not exceed the GPUs).
    ``start``: ``forkserver`` (torch imported once, below) or ``spawn`` (a fresh interpreter per rank)."""
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < world:
            raise RuntimeError(f"{getattr(fn, '__name__', fn)}: {world} ranks need {world} GPUs, "
                               f"{torch.cuda.device_count()} visible")
    ctx = _context("spawn" if device == "cuda" else start)
    results = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_worker, args=(r, world, port, threads, fn, args, tuple(spatial), results, device),
                         daemon=False) for r in range(world)]  # ranks may start loader workers
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    finished = False
    try:
        while len(got) < world:
            try:
                rank, ok, value = results.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline or not all(p.is_alive() or p.exitcode == 0 for p in procs):
                    raise RuntimeError(f"{getattr(fn, '__name__', fn)}: ranks did not finish "
                                       f"(exit codes {[p.exitcode for p in procs]})") from None
                continue
            if not ok:
                raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed on rank {rank}:\n{value}")
            got[rank] = value
        finished = True
    finally:
        for p in procs:
            if not finished:  # a failure, Ctrl-C or SIGTERM: the others may wait in a collective
                p.kill()
            p.join(timeout=10.0)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(world)]
