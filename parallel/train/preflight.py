"""Checks before training: bad input stops the job with one clear message, up front.

``validate_config`` checks the values Hydra's types cannot (lengths, signs, ranges) and
names the key. ``read_facts`` reads what the job needs to know about its samples (the
volume, the input's channels and stored bytes) once, from the first training file;
everything after is handed these ``SampleFacts``. ``check_data`` (collective) checks
the sample files of the train and val splits, each rank a share of the files
(``parallel.data.check.check_file``: readable HDF5, fields, dtypes, shapes, sample
counts, finite targets; ``data.check=deep`` reads every voxel), and that the grid can
split the volume. ``check_model`` traces the serial model on the meta device
(``parallel.plan.trace``: no memory, no compute) and checks that every activation along
a split dim still has a voxel per block, naming the layer otherwise. Every rank raises
the same ``InputError``, so the job ends cleanly without waiting for a timeout. See
``docs/failures.md``.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from parallel import comm

from parallel.data.check import check_file
from parallel.data.format import SampleSpec, read_manifest, sample_files
from parallel.grid import Grid
from parallel.partition import DIM_NAMES, SplitError
from parallel.train.config import JobConfig
from parallel.train.family import Family

log = logging.getLogger("parallel.train")

MAX_LISTED = 8  # problems quoted in the message; the rest are counted


class InputError(ValueError):
    """Bad data, config or model/grid combination, found before training. Raised alike on
    every rank (``collective``), so only rank 0 needs to report it."""

    collective = True


class ConfigError(InputError):
    """A config value that cannot work; the message names the key."""


def is_auto(spatial: Any) -> bool:
    """Whether ``parallel.spatial`` asks the planner to choose (``auto``)."""
    return isinstance(spatial, str) and spatial == "auto"


def validate_config(cfg: JobConfig) -> None:
    """Raise ``ConfigError`` naming the first key whose value cannot work."""
    spatial = cfg.parallel.spatial
    spatial_ok = is_auto(spatial) or isinstance(spatial, (list, tuple)) and len(spatial) == 3 and all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in spatial)
    checks: list[tuple[bool, str]] = [
        (spatial_ok, f"parallel.spatial={spatial}: want three positive ints [sd, sh, sw] or auto"),
        (isinstance(cfg.parallel.overlap_halo, bool) or cfg.parallel.overlap_halo == "auto",
         f"parallel.overlap_halo={cfg.parallel.overlap_halo}: want true, false or auto"),
        (cfg.parallel.timeout_s > 0, f"parallel.timeout_s={cfg.parallel.timeout_s}: want > 0"),
        (cfg.parallel.heartbeat_s > 0, f"parallel.heartbeat_s={cfg.parallel.heartbeat_s}: want > 0"),
        (cfg.train.global_batch_size >= 1,
         f"train.global_batch_size={cfg.train.global_batch_size}: want >= 1"),
        (cfg.train.accum_steps >= 1, f"train.accum_steps={cfg.train.accum_steps}: want >= 1"),
        (cfg.train.epochs >= 1, f"train.epochs={cfg.train.epochs}: want >= 1"),
        (cfg.train.max_steps >= 0, f"train.max_steps={cfg.train.max_steps}: want >= 0"),
        (cfg.train.max_skipped_steps >= 0, f"train.max_skipped_steps={cfg.train.max_skipped_steps}: want >= 0"),
        (cfg.data.workers >= 0, f"data.workers={cfg.data.workers}: want >= 0"),
        (cfg.run.keep_checkpoints >= 1, f"run.keep_checkpoints={cfg.run.keep_checkpoints}: want >= 1"),
        (cfg.run.log_every >= 1, f"run.log_every={cfg.run.log_every}: want >= 1"),
        (cfg.run.checkpoint_every >= 0, f"run.checkpoint_every={cfg.run.checkpoint_every}: want >= 0"),
        (cfg.optim.lr > 0, f"optim.lr={cfg.optim.lr}: want > 0"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def check_world(spatial: Sequence[int], world_size: int) -> None:
    """``ConfigError`` when ``parallel.spatial`` does not divide the world."""
    size = 1
    for s in spatial:
        size *= int(s)
    if world_size % size:
        sd, sh, sw = (int(s) for s in spatial)
        raise ConfigError(f"parallel.spatial=[{sd},{sh},{sw}] needs a multiple of {size} ranks, the job has "
                          f"{world_size}: data x spatial({sd}x{sh}x{sw}) cannot equal {world_size}")


@dataclass(frozen=True)
class SampleFacts:
    """What a job knows about its samples, read once (``read_facts``) and handed on: to the
    planner (``parallel.spatial=auto``), the checks, the readers and the model."""

    spec: SampleSpec
    """The family's sample spec, limited to the two fields trained on."""
    volume: tuple[int, int, int]
    """The global sample volume (D, H, W)."""
    channels: int
    """Channels of the input field."""
    input_itemsize: int
    """Bytes of one stored value of the input field."""
    source: Path
    """The file they were read from (the first training file)."""

    @property
    def stored_bytes_per_voxel(self) -> int:
        """Bytes of one voxel of the input field as stored (all channels)."""
        return self.input_itemsize * self.channels


def read_facts(cfg: JobConfig, family: Family, first: Path | None = None, key: str = "data.train_subdir"
               ) -> SampleFacts:
    """The ``SampleFacts`` of the job, from ``first`` (default: the first training file)."""
    spec = family.trained_spec()
    field = spec[family.input_field]
    if first is None:
        root = Path(cfg.data.dir) / cfg.data.train_subdir
        files = sample_files(root) if root.is_dir() else []
        if not files:
            raise InputError(f"{key}: no sample files under {root} (*.h5, *.hdf5)")
        first = files[0]
    import h5py

    try:
        with h5py.File(first, "r") as f:
            shape = f.attrs.get("global_shape")
            if shape is None and field.name in f and f[field.name].ndim >= 4:
                shape = f[field.name].shape[-3:]
            itemsize = f[field.name].dtype.itemsize if field.name in f else np.dtype(field.dtype).itemsize
    except OSError as err:
        raise InputError(f"{key}: {first}: cannot open as HDF5 (corrupt or truncated?): {err}") from err
    if shape is None or len(shape) != 3:
        raise InputError(f"{key}: {first}: no global_shape attribute and no volume field {field.name!r} "
                         "to take the volume from")
    volume = tuple(int(s) for s in shape)
    return SampleFacts(spec, volume, field.channels or 1, int(itemsize), Path(first))  # type: ignore[arg-type]


def _readable_dir(path: Path, key: str) -> None:
    if not path.exists():
        raise InputError(f"{key}: {path} does not exist")
    if not path.is_dir():
        raise InputError(f"{key}: {path} is not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise InputError(f"{key}: {path} is not readable (permissions)")


def _files(root: Path, key: str) -> tuple[list[Path], dict[str, int]]:
    """The sample files of a split and the sample counts its manifest claims."""
    _readable_dir(root, key)
    try:
        manifest = read_manifest(root)
    except (OSError, ValueError) as err:
        raise InputError(f"{key}: {root / 'manifest.json'} cannot be read ({err}); rewrite it with "
                         "parallel.data.write_manifest") from err
    counts: dict[str, int] = {}
    if manifest is not None:
        try:
            counts = {str(e["name"]): int(e["samples"]) for e in manifest["files"]}
        except (KeyError, TypeError, ValueError) as err:
            raise InputError(f"{key}: {root / 'manifest.json'} has no valid 'files' list "
                             f"of {{name, samples}} ({err})") from err
    files = sample_files(root)
    if not files:
        raise InputError(f"{key}: {root} holds no sample files (*.h5, *.hdf5)")
    return files, counts


def _manifest_problems(path: Path, claimed: int | None) -> list[str]:
    if claimed is None:
        return []
    import h5py

    try:
        with h5py.File(path, "r") as f:
            n = f.attrs.get("samples")
    except OSError:
        return []  # check_file reports it
    if n is not None and int(n) != claimed:
        return [f"manifest.json lists {claimed} samples, the file holds {int(n)}"]
    return []


def check_data(cfg: JobConfig, family: Family, grid: Grid, facts: SampleFacts | None = None) -> SampleFacts:
    """Check both splits' files (collective; each rank a share); the job's ``SampleFacts``
    (``facts`` if already read, else read here from the first training file).

    Raises ``InputError`` on every rank, quoting the first problems with their files.
    """
    mode = str(cfg.data.check)
    splits = [("train", cfg.data.train_subdir), ("val", cfg.data.val_subdir)]
    root = Path(cfg.data.dir)
    if not root.is_dir() or not os.access(root, os.R_OK | os.X_OK):
        _readable_dir(root, "data.dir")
    roots = []
    for split, sub in splits:
        path = root / sub
        if not path.exists():
            raise InputError(
                f"data.dir={cfg.data.dir!r} has no {sub}/ directory ({path}); generate a set with "
                f"{family.prepare_hint(cfg.data.dir)} or point data.dir at one")
        roots.append((f"data.{split}_subdir", path))
    listed = [(key, path, *_files(path, key)) for key, path in roots]
    if facts is None:
        facts = read_facts(cfg, family, listed[0][2][0], listed[0][0])
    spec, volume = facts.spec, facts.volume
    try:
        grid.block_range(volume)
    except SplitError as err:
        raise InputError(f"parallel.spatial={list(grid.spatial)} cannot split the volume {list(volume)} of "
                         f"{listed[0][1]}: {err}") from err
    problems: list[str] = []
    if mode != "none":
        every = [(p, counts.get(p.name)) for _, _, files, counts in listed for p in files]
        for i in range(grid.rank, len(every), grid.world_size):
            path, claimed = every[i]
            found = check_file(path, spec, deep=(mode == "deep"), volume=volume)
            found += _manifest_problems(path, claimed)
            problems.extend(f"{path}: {p}" for p in found)
    problems = _gather_lines(problems, grid)
    if problems:
        more = f" (and {len(problems) - MAX_LISTED} more)" if len(problems) > MAX_LISTED else ""
        raise InputError(f"{len(problems)} problem(s) in the sample files of data.dir={cfg.data.dir!r}{more}:\n  "
                         + "\n  ".join(problems[:MAX_LISTED])
                         + f"\n`{family.prepare or 'the prepare command'} check DIR` lists every problem")
    return facts


def _gather_lines(lines: list[str], grid: Grid) -> list[str]:
    """Every rank's lines, on every rank, in rank order (raw UTF-8 bytes, no pickle)."""
    if grid.world_size == 1:
        return lines
    merged: list[str] = []
    for raw in comm.all_gather_bytes(json.dumps(lines).encode(), grid.world_group, caller="preflight"):
        merged.extend(json.loads(raw.decode()))
    return merged


def check_model(family: Family, model_cfg: Any, volume: Sequence[int], channels: int, grid: Grid) -> None:
    """Raise ``InputError`` when a layer's input or output along a split dim has fewer
    voxels than blocks (a stride or pooling shrank it below the split), naming the layer.

    The serial model is traced on the meta device (``parallel.plan.trace``: shapes only,
    nothing is allocated).
    """
    from parallel.plan.trace import trace

    try:
        with torch.device("meta"):
            model = family.build_model(model_cfg, tuple(int(v) for v in volume))
    except (ValueError, TypeError) as err:  # the model's own checks of its config against the volume
        raise InputError(f"{family.name} model: {err}") from err
    if grid.spatial_size == 1:
        return
    try:
        layers = trace(model, (channels, *volume))
    except (NotImplementedError, RuntimeError) as err:
        if isinstance(err, NotImplementedError) or "meta" in str(err).lower():
            log.debug("shape check skipped: the model does not run on the meta device (%s)", err)
            return
        raise InputError(f"the model ({family.name}, model config {model_cfg}) cannot run on a volume of "
                         f"{list(volume)}: {err}") from err
    for layer in layers:
        if len(layer.in_shape) != 4 or len(layer.out_shape) != 4:
            continue
        n_in, n_out = layer.in_shape[1:], layer.out_shape[1:]
        for axis, parts in enumerate(grid.spatial):
            if parts > 1 and min(n_in[axis], n_out[axis]) < parts:
                raise InputError(
                    f"layer '{layer.name}' ({type(layer.module).__name__}): output size {n_out[axis]} along dim "
                    f"{DIM_NAMES[axis]} (input {n_in[axis]}) cannot be split {parts} ways for "
                    f"parallel.spatial={list(grid.spatial)} and a volume of {list(volume)}; use fewer "
                    f"blocks along {DIM_NAMES[axis]}, a larger volume or a shallower model")
