"""The run directory rule: a launch never writes over another run's results.

``run.dir`` holds a run when it has a checkpoint, ``metrics.jsonl``, ``mlperf.log`` or
``summary.json`` (``config.yaml`` and ``ranks.json`` alone, left by a launch that stopped
before training, do not count). Before anything is written, rank 0 decides
(``prepare``) and every rank follows (``parallel.train.lifecycle``):

- an empty or new directory: a new run;
- ``train.resume=true`` and a checkpoint: the run continues (the loop checks the
  checkpoint against the model before it moves or truncates any log);
- ``run.overwrite=true`` (or ``train.resume=true`` with no checkpoint to resume from):
  every old file moves to ``run.dir/previous_<k>/`` and a new run starts;
- otherwise the launch stops with exit status 2, naming the directory, the step it
  holds and the ways on.

The configs date their default ``run.dir`` (``runs/<model>/${now:%Y-%m-%d_%H-%M-%S}``);
ranks may resolve the date a second apart, so rank 0's directory is the job's.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from parallel.job.errors import InputError

log = logging.getLogger("parallel.train")

RESULTS = ("checkpoints", "metrics.jsonl", "mlperf.log", "summary.json")
"""What makes a directory hold a run."""
ASIDE = "previous_"
"""Prefix of the folders that keep replaced runs (``previous_1``, ``previous_2``, ...)."""


class RunDirError(InputError):
    """``run.dir`` holds a run this launch would overwrite."""


@dataclass(frozen=True)
class Held:
    """What an existing run directory holds."""

    checkpoint: Path | None
    """``checkpoints/last.pt`` (or the newest ``step_*.pt``), if any."""
    step: int | None
    """The step of the checkpoint, else the last step in ``metrics.jsonl``."""
    status: str | None
    """``summary.json``'s status (a run that ended), else None."""

    def describe(self) -> str:
        at = f"step {self.step}" if self.step is not None else "an unknown step"
        what = f"a checkpoint at {at}" if self.checkpoint is not None else f"logs up to {at} and no checkpoint"
        return what + (f", ended with status '{self.status}'" if self.status else ", not finished")


def held(run_dir: str | os.PathLike) -> Held | None:
    """What ``run_dir`` holds, or None when it holds no run."""
    root = Path(run_dir)
    present = [name for name in RESULTS if _nonempty(root / name)]
    if not present:
        return None
    ckpts = sorted((root / "checkpoints").glob("step_*.pt"))
    last = root / "checkpoints" / "last.pt"
    ckpt = last if last.is_file() else (ckpts[-1] if ckpts else None)
    step = _checkpoint_step(ckpt) if ckpt is not None else None
    if step is None:
        step = _last_logged_step(root / "metrics.jsonl")
    status = None
    try:
        status = str(json.loads((root / "summary.json").read_text(encoding="utf-8")).get("status"))
    except (OSError, ValueError, AttributeError):
        pass
    return Held(ckpt, step, status)


def _nonempty(path: Path) -> bool:
    if path.is_dir():
        return any(path.glob("*.pt"))
    return path.is_file() and path.stat().st_size > 0


def _checkpoint_step(path: Path) -> int | None:
    """The step of a checkpoint, read without loading its tensors (memory-mapped)."""
    import torch

    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("step"))
    except Exception:  # noqa: BLE001 - a damaged checkpoint still makes the directory a run's
        return None


def _last_logged_step(path: Path) -> int | None:
    step = None
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    step = int(json.loads(line)["step"])
                except (ValueError, KeyError, TypeError):
                    break
    except OSError:
        return None
    return step


def move_aside(run_dir: str | os.PathLike) -> Path:
    """Move every entry of ``run_dir`` (but earlier ``previous_*`` folders) into a new
    ``run_dir/previous_<k>/``; returns that folder."""
    root = Path(run_dir)
    k = 1
    while (root / f"{ASIDE}{k}").exists():
        k += 1
    aside = root / f"{ASIDE}{k}"
    aside.mkdir()
    for entry in sorted(root.iterdir()):
        if entry != aside and not entry.name.startswith(ASIDE):
            entry.rename(aside / entry.name)
    return aside


def prepare(run_dir: str, resume: bool, overwrite: bool) -> str:
    """Rank 0's decision for ``run_dir`` before anything is written; a line for the log.

    Raises ``RunDirError`` when the directory holds a run and neither ``resume`` (with a
    checkpoint) nor ``overwrite`` allows going on. Moves the old files aside for
    ``overwrite`` (and for ``resume`` without a checkpoint).
    """
    found = held(run_dir)
    if found is None:
        return f"run.dir={run_dir} (a new run)"
    if resume and found.checkpoint is not None:
        return f"run.dir={run_dir}: resuming from {found.checkpoint} (step {found.step})"
    if overwrite or resume:
        aside = move_aside(run_dir)
        why = "run.overwrite=true" if overwrite else "train.resume=true found no checkpoint to resume from"
        log.warning("run.dir=%s held %s; %s: its files moved to %s, a new run starts", run_dir,
                    found.describe(), why, aside)
        return f"run.dir={run_dir} (a new run; the previous one is in {aside})"
    raise RunDirError(
        f"run.dir={run_dir} already holds a run ({found.describe()}); nothing was written. Ways on: "
        f"continue it with train.resume=true; write elsewhere with run.dir=ANOTHER_DIR; or start afresh "
        f"there with run.overwrite=true (its files move to {Path(run_dir) / (ASIDE + '<k>')}/)")
