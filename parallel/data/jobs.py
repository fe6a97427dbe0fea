"""Running preparation jobs in parallel (processes, MPI ranks or both), resumably.

A job writes one or more output files, each atomically (temporary name, then rename), so
a job whose outputs all exist is done: an interrupted run started again skips it. Under
``mpirun`` each rank takes every ``size``-th job; each rank may also use a process pool.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One unit of preparation: ``fn(*args)`` writes ``outputs`` and returns bytes written."""

    outputs: tuple[Path, ...]
    args: tuple[Any, ...] = field(default_factory=tuple)

    def done(self) -> bool:
        return all(p.exists() for p in self.outputs)


@dataclass
class JobReport:
    """Jobs run and skipped (already done) by this rank, and bytes written."""

    run: int = 0
    skipped: int = 0
    bytes: int = 0


class _Mpi:
    """MPI rank, size, ranks on this node and barrier when launched by mpirun, else a world of one."""

    def __init__(self) -> None:
        from parallel.runtime.launch import detect_launcher

        self.comm = None
        self.rank, self.size, self.local_size = 0, 1, 1
        if detect_launcher() == "mpi":
            from mpi4py import MPI

            self.comm = MPI.COMM_WORLD
            self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
            # The ranks sharing this node, from MPI itself (collective: every rank builds this once).
            self.local_size = self.comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()

    def barrier(self) -> None:
        if self.comm is not None:
            self.comm.Barrier()

    def total(self, report: "JobReport") -> "JobReport":
        """The report summed over all ranks (collective: every rank must call it)."""
        if self.comm is None:
            return report
        import numpy as np
        from mpi4py import MPI

        mine = np.array([report.run, report.skipped, report.bytes], dtype=np.int64)
        out = np.zeros_like(mine)
        self.comm.Allreduce(mine, out, op=MPI.SUM)
        return JobReport(run=int(out[0]), skipped=int(out[1]), bytes=int(out[2]))


_MPI: _Mpi | None = None


def mpi() -> _Mpi:
    """The MPI view of this process (created once)."""
    global _MPI
    if _MPI is None:
        _MPI = _Mpi()
    return _MPI


def _call(item: tuple[Callable[..., int], tuple[Any, ...]]) -> int:
    fn, args = item
    return int(fn(*args) or 0)


def run_jobs(fn: Callable[..., int], jobs: Sequence[Job], workers: int = 1, desc: str = "prepare",
             progress: bool = True) -> JobReport:
    """Run the jobs not yet done (this MPI rank's share), ``workers`` processes at a time.

    ``fn`` must be a module-level function (it is sent to worker processes). Returns the
    report summed over all MPI ranks, after every rank has finished (a collective), so
    rank 0 may then write a manifest.
    """
    world = mpi()
    mine = list(jobs)[world.rank::world.size]
    todo = [j for j in mine if not j.done()]
    report = JobReport(skipped=len(mine) - len(todo))
    if report.skipped:
        log.info("%s: %d of %d jobs already done, resuming", desc, report.skipped, len(mine))
    for job in todo:
        for out in job.outputs:
            out.parent.mkdir(parents=True, exist_ok=True)
    items = [(fn, j.args) for j in todo]
    bar = None
    if progress and world.rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc=desc, unit="job")
    if workers > 1 and len(items) > 1:
        with ProcessPoolExecutor(min(workers, len(items))) as pool:
            for nbytes in pool.map(_call, items):
                report.bytes += nbytes
                report.run += 1
                if bar is not None:
                    bar.update()
    else:
        for item in items:
            report.bytes += _call(item)
            report.run += 1
            if bar is not None:
                bar.update()
    if bar is not None:
        bar.close()
    return world.total(report)


def default_workers() -> int:
    """Processes per rank: the cores this process may use, shared among local ranks."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // max(mpi().local_size, 1))
