"""The sample files of a job: read once, checked once (collective).

``read_facts`` reads what the job needs to know about its samples (the volume, the
input's channels and stored bytes) once, from the first training file; everything after
is handed these ``SampleFacts``. ``check_data`` (collective) checks the sample files of
the train and val splits, each rank a share of the files
(``parallel.data.check.check_file``: readable HDF5, fields, dtypes, shapes, sample
counts, finite targets; ``data.check=deep`` reads every voxel), that the grid can split
the volume, and gathers every case's shape for the fit check (``checks.fit``). Every
rank raises the same ``InputError``, so the job ends cleanly without waiting for a
timeout. See ``docs/failures.md``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parallel import comm
from parallel.data.check import check_file
from parallel.data.format import SampleSpec, read_manifest, sample_files
from parallel.grid import Grid
from parallel.job.config import DataConfig
from parallel.job.errors import InputError, quote_problems
from parallel.job.family import Family
from parallel.partition import SplitError
from parallel.train.checks.fit import weights_depend_on_volume

log = logging.getLogger("parallel.train")


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
    train_shapes: tuple[tuple[str, tuple[int, int, int]], ...] = ()
    """(file, (D, H, W)) of every training file (``check_data``; cases may differ in shape)."""
    val_shapes: tuple[tuple[str, tuple[int, int, int]], ...] = ()
    """(file, (D, H, W)) of every validation file."""

    @property
    def stored_bytes_per_voxel(self) -> int:
        """Bytes of one voxel of the input field as stored (all channels)."""
        return self.input_itemsize * self.channels


def read_facts(data: DataConfig, family: Family, first: Path | None = None, key: str = "data.train_subdir"
               ) -> SampleFacts:
    """The ``SampleFacts`` of the job (``data``: its data section), from ``first`` (default:
    the first training file)."""
    spec = family.trained_spec(crops=data.crop is not None and data.oversampling > 0)
    field = spec[family.input_field]
    if first is None:
        key, root = _split_roots(data, family, ("train",))[0]
        first = _files(root, key)[0][0]
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


def _split_roots(data: DataConfig, family: Family, splits: tuple[str, ...] = ("train", "val")
                 ) -> list[tuple[str, Path]]:
    """(key, directory) of the ``splits``; ``InputError`` saying how to make a data set
    where ``data.dir`` or a split is missing or unreadable."""
    root = Path(data.dir)
    if not root.exists():
        raise InputError(f"data.dir: {root} does not exist; generate a set with {family.prepare_hint(data.dir)} "
                         "or point data.dir at one")
    if not root.is_dir() or not os.access(root, os.R_OK | os.X_OK):
        _readable_dir(root, "data.dir")
    roots = []
    for split in splits:
        sub = data.train_subdir if split == "train" else data.val_subdir
        path = root / sub
        if not path.exists():
            raise InputError(
                f"data.dir={data.dir!r} has no {sub}/ directory ({path}); generate a set with "
                f"{family.prepare_hint(data.dir)} or point data.dir at one")
        roots.append((f"data.{split}_subdir", path))
    return roots


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


def check_data(data: DataConfig, model_cfg: Any, family: Family, grid: Grid,
               facts: SampleFacts | None = None) -> SampleFacts:
    """Check both splits' files (collective; each rank a share); the job's ``SampleFacts``
    (``facts`` if already read, else read here from the first training file). ``data``:
    the job's data section; ``model_cfg``: its model section (whether the network's
    weights fix the volume every case must have).

    Raises ``InputError`` on every rank, quoting the first problems with their files.
    """
    mode = str(data.check)
    roots = _split_roots(data, family)
    listed = [(key, path, *_files(path, key)) for key, path in roots]
    if facts is None:
        facts = read_facts(data, family, listed[0][2][0], listed[0][0])
    spec, volume = facts.spec, facts.volume
    try:
        if data.crop is None:  # crops are checked against the split instead (checks.fit)
            grid.block_range(volume)
    except SplitError as err:
        raise InputError(f"parallel.spatial={list(grid.spatial)} cannot split the volume {list(volume)} of "
                         f"{listed[0][1]}: {err}") from err
    problems: list[str] = []
    # cases may differ in shape, unless the network's weights fix its volume
    one_volume = volume if data.crop is None and weights_depend_on_volume(family, model_cfg, volume) else None
    every = [(p, counts.get(p.name), split) for split, (_, _, files, counts) in enumerate(listed) for p in files]
    shapes: list[str] = []  # "split path D H W" of this rank's share: every case has its own shape
    for i in range(grid.rank, len(every), grid.world_size):
        path, claimed, split = every[i]
        samples, shape = _declared(path)
        if mode != "none":
            found = check_file(path, spec, deep=(mode == "deep"), volume=one_volume)
            if claimed is not None and samples is not None and samples != claimed:
                found.append(f"manifest.json lists {claimed} samples, the file holds {samples}")
            problems.extend(f"{path}: {p}" for p in found)
        if shape is not None:
            shapes.append(json.dumps([split, str(path), list(shape)]))
    problems = _gather_lines(problems, grid)
    if problems:
        raise InputError(quote_problems(f"problem(s) in the sample files of data.dir={data.dir!r}", problems,
                                f"\n`{family.prepare or 'the prepare command'} check DIR` lists every problem"))
    found_shapes: list[tuple[tuple[str, tuple[int, int, int]], ...]] = [(), ()]
    for line in sorted(_gather_lines(shapes, grid), key=lambda t: (json.loads(t)[0], json.loads(t)[1])):
        split, path, shape = json.loads(line)
        found_shapes[split] += ((path, tuple(shape)),)
    return dataclasses.replace(facts, train_shapes=found_shapes[0], val_shapes=found_shapes[1])


def _declared(path: Path) -> tuple[int | None, tuple[int, int, int] | None]:
    """The sample count and the (D, H, W) a sample file declares in its attributes, from one
    open (None where absent or unreadable: the file check says why)."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            samples, shape = f.attrs.get("samples"), f.attrs.get("global_shape")
    except OSError:
        return None, None
    volume = tuple(int(n) for n in shape) if shape is not None and len(shape) == 3 else None
    return (int(samples) if samples is not None else None), volume  # type: ignore[return-value]


def _gather_lines(lines: list[str], grid: Grid) -> list[str]:
    """Every rank's lines, on every rank, in rank order (raw UTF-8 bytes, no pickle)."""
    if grid.world_size == 1:
        return lines
    merged: list[str] = []
    for raw in comm.all_gather_bytes(json.dumps(lines).encode(), grid.world_group, caller="checks.samples"):
        merged.extend(json.loads(raw.decode()))
    return merged
