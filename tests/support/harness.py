"""Run a function on several real processes joined by gloo, and collect what each returns.

A pool of ranks is started once per world size and reused by many test cases (a fresh
interpreter importing torch costs seconds on a 2-core machine; the ranks are forked from a
server that imported it once: ``forkstart``). A case is a module-level
function ``fn(grid, *args)``; every rank runs it with a ``Grid`` for the requested
spatial split. A failure on any rank, or a case that outlasts its timeout, tears the
pool down (so no rank is left waiting in a collective) and fails the test with every
rank's traceback.

``SPATIALCNN_TEST_DEVICE=cuda`` runs the ranks on GPUs instead (NCCL, one GPU per rank,
TF32 off): the same cases, on the device they are meant for (``scripts/gpu_check.sh``).
A world larger than the GPUs present is skipped.
"""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from collections import OrderedDict
from datetime import timedelta
from typing import Any, Callable, Sequence

import forkstart
from parallel.runtime.launch import free_port

DEVICE = os.environ.get("SPATIALCNN_TEST_DEVICE", "cpu")
# A rank keeps the process groups of its last few grids only. Every gloo group has a device
# loop thread that wakes each 10 ms: a pool that kept every grid it was asked for (dozens
# over a session, four groups each) spent a tenth of a core per 4 ranks while idle.
KEEP_GRIDS = 4


def _release(grid: Any) -> None:
    """End a grid's own process groups (not the world's); a local call on every rank alike."""
    import torch.distributed as dist

    seen: list[Any] = []
    for group in (grid.spatial_group, grid.data_group, grid.grad_group, grid.grad_data_group,
                  getattr(grid, "grad_spatial_group", None)):
        if group is None or group is dist.group.WORLD or any(group is g for g in seen):
            continue
        seen.append(group)
        dist.destroy_process_group(group)


def _worker(rank: int, world: int, port: int, jobs: Any, results: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from parallel import comm
    from parallel.grid import Grid
    from parallel.runtime.launch import configure_cuda

    torch.set_num_threads(1)
    device = torch.device("cpu")
    if DEVICE == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        configure_cuda(tf32=False)
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=60))
    comm.barrier(None)  # a first operation that involves every rank (NCCL's rule for point-to-point)
    grids: OrderedDict[tuple[int, int, int], Grid] = OrderedDict()  # least recently used first
    try:
        while True:
            job = jobs.get()
            if job is None:
                dist.destroy_process_group()
                os._exit(0)  # every result was taken; skip the interpreter's slow teardown of torch
            if job == "release":  # between test modules: the world group alone stays
                while grids:
                    _release(grids.popitem(last=False)[1])
                results.put((rank, True, None))
                continue
            fn, args, spatial = job
            try:
                if spatial in grids:
                    grids.move_to_end(spatial)
                else:  # every rank runs the same jobs: they release and create groups alike
                    while len(grids) >= KEEP_GRIDS:
                        _release(grids.popitem(last=False)[1])
                    grids[spatial] = Grid.from_world(spatial, device=device)
                results.put((rank, True, fn(grids[spatial], *args)))
            except BaseException:  # noqa: BLE001 - report everything to the test process
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankPool:
    """``world`` spawned ranks with a gloo process group, waiting for cases."""

    def __init__(self, world: int) -> None:
        ctx = forkstart.context()
        self.world = world
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world)]
        port = free_port("127.0.0.1")
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.jobs[r], self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable[..., Any], *args: Any, spatial: Sequence[int] = (1, 1, 1),
            timeout: float = 120.0) -> list[Any]:
        """Run ``fn(grid, *args)`` on every rank; return the per-rank results in rank order."""
        pickle.dumps((fn, args))  # fail here, not silently in the queue's feeder thread
        for q in self.jobs:
            q.put((fn, args, tuple(spatial)))
        got: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(got) + len(errors) < self.world:
            # Once a rank has failed, the others are likely stuck in a collective: wait briefly.
            wait = min(deadline, time.monotonic() + 3.0) if errors else deadline
            try:
                rank, ok, value = self.results.get(timeout=max(0.1, wait - time.monotonic()))
            except queue.Empty:
                if not errors and time.monotonic() < deadline and self.alive:
                    continue
                break
            (got if ok else errors)[rank] = value
        if errors or len(got) < self.world:
            self.close()
            silent = sorted(set(range(self.world)) - set(got) - set(errors))
            report = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            if silent:
                report += f"\nranks {silent} did not finish within {timeout:.0f} s (killed)"
            raise AssertionError(f"{getattr(fn, '__name__', fn)} failed on {self.world} ranks:{report}")
        return [got[r] for r in range(self.world)]

    def release(self, timeout: float = 60.0) -> None:
        """End every grid's process groups on every rank (the world group stays)."""
        for q in self.jobs:
            q.put("release")
        deadline = time.monotonic() + timeout
        for _ in range(self.world):
            self.results.get(timeout=max(0.1, deadline - time.monotonic()))

    def close(self, deadline: float | None = None) -> None:
        self.signal_end()
        self.reap(time.monotonic() + 5.0 if deadline is None else deadline)

    def signal_end(self) -> None:
        """Ask every worker to leave (they end their process group and exit)."""
        for q in self.jobs:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass

    def reap(self, deadline: float) -> None:
        """Wait for the workers until ``deadline``, then kill the ones left."""
        for p in self.procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)


class Pools:
    """One live ``RankPool`` per world size, replaced when a failure killed it."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def run(self, world: int, fn: Callable[..., Any], *args: Any, spatial: Sequence[int] = (1, 1, 1),
            timeout: float = 120.0) -> list[Any]:
        if DEVICE == "cuda":
            import pytest
            import torch

            if world > torch.cuda.device_count():
                pytest.skip(f"{world} ranks need {world} GPUs, {torch.cuda.device_count()} present")
        pool = self._pools.get(world)
        if pool is None or not pool.alive:
            pool = self._pools[world] = RankPool(world)
        try:
            return pool.run(fn, *args, spatial=spatial, timeout=timeout)
        except AssertionError:
            self._pools.pop(world, None)
            raise

    def idle(self, keep: int = 4) -> None:
        """Between test modules: worlds over ``keep`` ranks end, the others keep their world
        group only. An idle rank costs CPU for each process group it holds (a gloo device
        loop waking every 10 ms), and the suite's pools sit idle while the other modules run."""
        for world in [w for w in self._pools if w > keep]:
            self._pools.pop(world).close()
        for world, pool in list(self._pools.items()):
            try:
                pool.release()
            except (queue.Empty, OSError, ValueError):
                self._pools.pop(world).close()  # a pool that cannot release is replaced at its next use

    def close(self) -> None:
        """End every world at once (not one after another: each waits for its workers)."""
        for pool in self._pools.values():
            pool.signal_end()
        deadline = time.monotonic() + 5.0
        for pool in self._pools.values():
            pool.reap(deadline)
        self._pools.clear()
