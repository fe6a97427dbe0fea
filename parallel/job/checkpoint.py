"""The checkpoint file of a run: where it lives, how it is written and read back.

``run.dir/checkpoints/last.pt`` holds plain tensors and Python scalars only, so it loads
with ``torch.load(path, weights_only=True)`` (``load``; never arbitrary pickled objects):

- ``model``: the serial model's ``state_dict`` (the same keys at any grid, so a checkpoint
  from one grid loads at any other grid and serially);
- ``optimizer``: the optimiser's ``state_dict`` (parameters in the serial model's order);
- ``step``, ``epoch``, ``samples``: progress; ``sampler``: the sampler's state;
- ``rng``: every rank's RNG streams (torch's, CUDA's and the dropout layers' own; their
  layout is ``parallel.train.persist.rng``'s), restored only at the same world size, so
  dropout masks repeat exactly; ``scaler``: the fp16 grad scaler;
- ``meta``: the family, volume and model config it was written for (a resume checks
  them, ``check_matches``, and says what differs) and the grid, for reference;
- ``replicas``: the replica check it was written after (``parallel.train.replicas``:
  ``checked``, ``agree``, ``step``, ``world_size``; ``checked`` false with the check off).

``write`` puts a payload in place atomically: a temporary file, flushed to disk, renamed
over ``last.pt`` (``os.replace``), so a job killed mid-write leaves the previous checkpoint
intact. With ``keep > 1`` the newest ``keep`` checkpoints stay as ``step_<step>.pt``
(``last.pt`` is a hard link to the newest); ``load_latest`` falls back to the newest
readable one when ``last.pt`` cannot be read. The training loop writes through
``parallel.train.persist.writer`` (in a background thread, at step boundaries).
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("parallel.train")


def checkpoint_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints" / "last.pt"


def kept(directory: str | os.PathLike) -> list[Path]:
    """The numbered checkpoints ``step_<step>.pt`` of a directory, oldest first."""
    return sorted(Path(directory).glob("step_*.pt"))


def write(path: Path, payload: dict[str, Any], keep: int) -> None:
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
