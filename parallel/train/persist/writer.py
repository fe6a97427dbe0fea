"""Checkpoints written during training: at step boundaries, in a background thread.

Every rank gathers the RNG streams (a collective); rank 0 takes a CPU copy of the state
and a thread writes it (``parallel.job.checkpoint.write``: temporary file, fsync, rename)
while training goes on. The file's contents and how it is read back:
``parallel.job.checkpoint``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallel import comm
from parallel.grid import Grid
from parallel.job.checkpoint import CheckpointError, write
from parallel.train.persist.rng import rng_state

log = logging.getLogger("parallel.train")


def gather_rng(grid: Grid, model: nn.Module | None = None) -> torch.Tensor:
    """Every rank's ``rng_state``, stacked (world, L), on every rank."""
    state = rng_state(model)
    if grid.world_size == 1:
        return state[None]
    # lengths may differ between ranks (a CUDA rank also keeps its device generators)
    parts = comm.all_gather_varlen(state.to(grid.device), grid.world_group, caller="checkpoint.gather_rng")
    longest = max(p.numel() for p in parts)
    if any(p.numel() != longest for p in parts):
        raise CheckpointError(f"ranks keep RNG states of different lengths ({sorted({p.numel() for p in parts})} "
                              "bytes); every rank of a job must run on the same kind of device")
    return torch.stack([p.cpu() for p in parts])


def save(path: str | os.PathLike, grid: Grid, state: dict[str, Any], model: nn.Module | None = None,
         keep: int = 1) -> None:
    """Write ``state`` atomically (collective: every rank calls it; rank 0 writes).

    ``state`` must already hold the serial model's state_dict under ``model``; this adds
    the per-rank RNG states. ``keep > 1`` also keeps the newest ``keep`` checkpoints as
    ``step_<step>.pt`` next to ``path``. Returns once the file is in place on every rank
    (``Writer`` writes in the background instead).
    """
    Writer(background=False).save(path, grid, state, model, keep)


class Writer:
    """Writes the run's checkpoints, in a background thread with ``background``.

    At the step boundary every rank gathers the RNG states (a collective) and rank 0 takes
    a copy of the state on the CPU (``snapshot``); a thread then writes that copy
    (``parallel.job.checkpoint.write``: temporary file, fsync, rename), while training goes on. A save first
    waits for the previous write, and ``finish`` (the run's end) waits for the last one,
    so at most one write is in flight and the file appears whole or not at all. A kill
    during a write leaves the previous checkpoint in place.

    The costs are counted: ``step_s``, the time the training steps spent on checkpoints
    (the RNG gather, the copy and any wait for the previous write); ``write_s``, the time
    the writes took (rank 0; in the background when ``background``).
    """

    def __init__(self, background: bool = True) -> None:
        self.background = background
        self.count = 0
        self.step_s = 0.0
        self.write_s = 0.0
        self.written_step: int | None = None
        """The step of the newest checkpoint known to be complete on disk (rank 0)."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, path: str | os.PathLike, grid: Grid, state: dict[str, Any], model: nn.Module | None = None,
             keep: int = 1) -> None:
        """Start writing ``state`` (collective; see ``save``). ``state`` may change once this returns."""
        t0 = time.perf_counter()
        self.wait()
        rng = gather_rng(grid, model)
        if grid.rank == 0:
            payload = snapshot(state) if self.background else dict(state)
            payload["rng"] = {"states": rng, "world_size": grid.world_size, "spatial": list(grid.spatial)}
            if self.background:
                self._thread = threading.Thread(target=self._run, args=(Path(path), payload, keep),
                                                name="checkpoint-writer")
                self._thread.start()
            else:
                self._run(Path(path), payload, keep)
                self._raise()
        if not self.background:
            comm.barrier(grid.world_group, caller="checkpoint.save")
        self.count += 1
        self.step_s += time.perf_counter() - t0

    def _run(self, path: Path, payload: dict[str, Any], keep: int) -> None:
        t0 = time.perf_counter()
        try:
            write(path, payload, keep)
            self.written_step = int(payload.get("step", 0))
        except BaseException as exc:  # noqa: BLE001 - raised in the training thread by wait()
            self._error = exc
        self.write_s += time.perf_counter() - t0

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"writing a checkpoint failed: {type(err).__name__}: {err}") from err

    def wait(self) -> None:
        """Wait for the write in flight (if any); raise its failure here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def drain(self, timeout_s: float = 60.0) -> None:
        """Let the write in flight end (at most ``timeout_s``) before the process is ended
        for a failure: the copy taken is saved rather than lost (errors are logged only)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("checkpoint write still running after %.0f s; the previous checkpoint stays", timeout_s)

    def finish(self, grid: Grid) -> None:
        """The run's end (collective): the last write is on disk before any rank goes on."""
        t0 = time.perf_counter()
        self.wait()
        comm.barrier(grid.world_group, caller="checkpoint.finish")
        self.step_s += time.perf_counter() - t0

    def costs(self) -> dict[str, Any]:
        """What the checkpoints cost this session (for the summary)."""
        n = max(self.count, 1)
        return {"written": self.count, "background": self.background, "step_seconds": self.step_s,
                "write_seconds": self.write_s, "step_seconds_each": self.step_s / n,
                "write_seconds_each": self.write_s / n}


def snapshot(obj: Any) -> Any:
    """A copy of a state (nested dicts, lists, tensors) whose tensors are on the CPU and
    share no memory with the originals, so training may change them during the write."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return obj


def wall_due(grid: Grid, since: float, every_s: float) -> bool:
    """Whether ``every_s`` seconds of wall time passed since ``since`` (``time.perf_counter``)
    on rank 0's clock. Collective (one integer broadcast over the CPU group), so every rank
    takes the same decision and enters the checkpoint's collectives together."""
    due = torch.tensor([int(time.perf_counter() - since >= every_s)], dtype=torch.int64)
    if grid.world_size > 1:
        group = getattr(grid, "cpu_group", None) or grid.world_group
        comm.broadcast_(due, 0, group, caller="checkpoint.wall_due")
    return bool(due.item())
