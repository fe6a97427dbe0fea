"""Checkpoints: the serial model's state_dict plus everything an exact resume needs.

``run.dir/checkpoints/last.pt`` holds plain tensors and Python scalars only, so it loads
with ``torch.load(path, weights_only=True)``:

- ``model``: the serial model's ``state_dict`` (the same keys at any grid, so a checkpoint
  from one grid loads at any other grid and serially);
- ``optimizer``: the optimiser's ``state_dict`` (parameters in the serial model's order);
- ``step``, ``epoch``, ``samples``: progress; ``sampler``: the sampler's state;
- ``rng``: every rank's RNG streams (torch's, CUDA's and the dropout layers' own; their
  layout is ``parallel.train.persist.rng``'s),
  restored only at the same world size, so dropout masks repeat exactly;
  ``scaler``: the fp16 grad scaler;
- ``meta``: the family, volume and model config it was written for (a resume checks
  them and says what differs) and the grid, for reference.

Rank 0 writes to a temporary file, flushes it to disk and renames it over ``last.pt``
(``os.replace``), so a job killed mid-write leaves the previous checkpoint intact; the
training loop's ``Writer`` does that in a background thread from a copy of the state. With
``keep > 1`` the newest ``keep`` checkpoints stay as ``step_<step>.pt`` (``last.pt`` is a
hard link to the newest); a resume whose ``last.pt`` cannot be read falls back to the
newest readable one.
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import torch
from parallel import comm
from torch import nn

from parallel.grid import Grid
from parallel.train.persist.rng import rng_state

log = logging.getLogger("parallel.train")


def checkpoint_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints" / "last.pt"


def kept(directory: str | os.PathLike) -> list[Path]:
    """The numbered checkpoints ``step_<step>.pt`` of a directory, oldest first."""
    return sorted(Path(directory).glob("step_*.pt"))


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
    (``_write``: temporary file, fsync, rename), while training goes on. A save first
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
            _write(path, payload, keep)
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


def _write(path: Path, payload: dict[str, Any], keep: int) -> None:
    """Rank 0's file work: temporary file, fsync, rename (and the numbered copies)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    if keep > 1:
        numbered = path.with_name(f"step_{int(payload.get('step', 0)):09d}.pt")
        os.replace(tmp, numbered)
        _link_or_copy(numbered, tmp)
        os.replace(tmp, path)
        for old in kept(path.parent)[:-keep]:
            old.unlink(missing_ok=True)
    else:
        os.replace(tmp, path)
    _fsync_dir(path.parent)
    log.debug("checkpoint step %s written to %s", payload.get("step"), path)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # no hard links on this file system
        import shutil

        shutil.copyfile(src, dst)


def _fsync_dir(directory: Path) -> None:
    """Make the renames durable (a crash of the node right after cannot undo them)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read, or does not fit this run; the message says why."""


# A damaged file fails in many ways (zip reader, unpickler, struct): all mean "unreadable".
_UNREADABLE = (RuntimeError, EOFError, OSError, ValueError, KeyError, IndexError, TypeError, struct.error,
               pickle.UnpicklingError, zipfile.BadZipFile)


def load(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint safely (``weights_only=True``: tensors and plain values only,
    never arbitrary pickled objects); a clear error if it is missing or unreadable."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except _UNREADABLE as err:
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''})") from err


def load_latest(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], Path]:
    """``path`` if it reads, else the newest readable ``step_<step>.pt`` beside it."""
    path = Path(path)
    candidates = [path] + [p for p in reversed(kept(path.parent)) if p.name != path.name]
    errors = []
    for p in candidates:
        if not p.is_file():
            continue
        try:
            ckpt = load(p, map_location)
        except CheckpointError as err:
            errors.append(str(err))
            log.warning("%s; trying an older checkpoint", err)
            continue
        return ckpt, p
    if errors:
        raise CheckpointError("no readable checkpoint: " + "; ".join(errors))
    raise FileNotFoundError(f"no checkpoint at {path}")


def check_matches(ckpt: dict[str, Any], expected: dict[str, Any], path: str | os.PathLike) -> None:
    """Raise ``CheckpointError`` naming every field of ``meta`` that differs from ``expected``
    (family, volume, the model config's fields), so a resume never loads the wrong model."""
    meta = ckpt.get("meta") or {}
    diffs = []
    for key, want in expected.items():
        if key not in meta:
            continue  # older checkpoints lack some fields: the state_dict load still checks shapes
        have = meta[key]
        if isinstance(want, dict) and isinstance(have, dict):
            for k in sorted(set(want) | set(have)):
                if _plain(have.get(k)) != _plain(want.get(k)):
                    diffs.append(f"{key}.{k}: checkpoint {have.get(k)!r}, this run {want.get(k)!r}")
        elif _plain(have) != _plain(want):
            diffs.append(f"{key}: checkpoint {have!r}, this run {want!r}")
    if diffs:
        raise CheckpointError(f"checkpoint {path} was written for another model; it differs in "
                              + "; ".join(diffs) + " (use another run.dir, or the checkpoint's settings)")


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, str):
        return str(value)  # Choice enums compare by their value
    return value


def wall_due(grid: Grid, since: float, every_s: float) -> bool:
    """Whether ``every_s`` seconds of wall time passed since ``since`` (``time.perf_counter``)
    on rank 0's clock. Collective (one integer broadcast over the CPU group), so every rank
    takes the same decision and enters the checkpoint's collectives together."""
    due = torch.tensor([int(time.perf_counter() - since >= every_s)], dtype=torch.int64)
    if grid.world_size > 1:
        group = getattr(grid, "cpu_group", None) or grid.world_group
        comm.broadcast_(due, 0, group, caller="checkpoint.wall_due")
    return bool(due.item())
