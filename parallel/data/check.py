"""Validation of prepared sample files: every bad file, with the reason.

Each file is opened, every field of the spec is checked for presence, dtype and shape,
the sample counts must agree, and (``deep``, the default) every value is read, chunk by
chunk, so that corrupt compressed chunks surface, and fields marked ``finite`` (targets,
float images) or with a ``valid_range`` (labels) are checked value by value. Without
``deep`` the small scalar fields (targets) are still read and checked (``scalars``).
Each file is checked against its own volume: cases of one split may differ in shape.
A spec's own ``checks`` (cross-field consistency) run last, on files sound so far.
The training job's checks (``parallel.train.checks.samples``) call ``check_file``.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Iterator, Sequence

import h5py
import numpy as np

import parallel.data.codecs  # noqa: F401  (registers the HDF5 compression filters)
from parallel.data.format import FieldSpec, SampleSpec, sample_files

log = logging.getLogger(__name__)

SLAB_BYTES = 64 << 20


def check_file(path: str | os.PathLike, spec: SampleSpec, deep: bool = True,
               volume: Sequence[int] | None = None, scalars: bool = True) -> list[str]:
    """The problems of one sample file (empty when it is good).

    ``volume``: the (D, H, W) every volume field must have (default: the file's own, set
    by its first volume field; pass one only where a split must hold one shape). ``scalars``: without ``deep``, still read the scalar fields.
    """
    path = Path(path)
    try:
        f = h5py.File(path, "r")
    except OSError as err:
        return [f"cannot open as HDF5 (corrupt or truncated?): {err}"]
    problems: list[str] = []
    with f:
        samples = None
        volume = tuple(int(v) for v in volume) if volume is not None else None
        for fs in spec.fields:
            if fs.name not in f or not isinstance(f[fs.name], h5py.Dataset):
                problems.append(f"field {fs.name!r} is missing (has {sorted(f.keys())})")
                continue
            dset = f[fs.name]
            if dset.dtype != np.dtype(fs.dtype):
                problems.append(f"field {fs.name!r} is {dset.dtype}, want {fs.dtype}")
            if dset.ndim < 1:
                problems.append(f"field {fs.name!r} is a scalar, want a leading sample axis")
                continue
            if samples is None:
                samples = dset.shape[0]
            elif dset.shape[0] != samples:
                problems.append(f"field {fs.name!r} has {dset.shape[0]} samples, others {samples}")
            want = _want_shape(fs, dset.shape, volume)
            if fs.kind == "volume" and volume is None and dset.ndim == len(want) + 1:
                volume = dset.shape[-3:]
            if tuple(dset.shape[1:]) != want:
                problems.append(f"field {fs.name!r} has sample shape {tuple(dset.shape[1:])}, want {want}")
                continue
            if deep or (scalars and fs.kind == "scalar"):
                problems.extend(_check_values(dset, fs))
        if not problems:
            for extra in spec.checks:
                problems.extend(extra(f, deep))
        n_attr = f.attrs.get("samples")
        if n_attr is not None and samples is not None and int(n_attr) != samples:
            problems.append(f"attribute samples={int(n_attr)} but the fields hold {samples}")
    return problems


def _want_shape(fs: FieldSpec, shape: tuple[int, ...], volume: tuple[int, ...] | None) -> tuple[int, ...]:
    if fs.kind == "scalar":
        return tuple(fs.shape)
    spatial = volume if volume is not None else tuple(shape[-3:])
    return fs.sample_shape(spatial)


def _check_values(dset: h5py.Dataset, fs: FieldSpec) -> list[str]:
    """Read every value (in slabs along the sample and depth axes) and check it."""
    problems: list[str] = []
    bad_finite = 0
    bad_range = 0
    for sel in _slabs(dset):
        try:
            data = dset[sel]
        except (OSError, ValueError) as err:
            where = [(s.start, s.stop) for s in sel]
            return problems + [f"field {fs.name!r} cannot be read at {where} ({err})"]
        if fs.finite and np.issubdtype(data.dtype, np.floating):
            bad_finite += int(data.size - np.count_nonzero(np.isfinite(data)))
        if fs.valid_range is not None:
            lo, hi = fs.valid_range
            bad_range += int(np.count_nonzero((data < lo) | (data > hi)))
    if bad_finite:
        problems.append(f"field {fs.name!r} has {bad_finite} non-finite values (NaN or inf), want all finite")
    if bad_range:
        problems.append(f"field {fs.name!r} has {bad_range} values outside {list(fs.valid_range)}, "
                        "want all inside")
    return problems


def _slabs(dset: h5py.Dataset) -> Iterator[tuple[slice, ...]]:
    full = [slice(0, n) for n in dset.shape]
    if dset.ndim < 3:
        yield tuple(full)
        return
    depth_axis = dset.ndim - 3
    per_index = dset.dtype.itemsize * int(np.prod(dset.shape[1:])) // max(dset.shape[depth_axis], 1)
    step = max(1, SLAB_BYTES // max(per_index, 1))
    if dset.chunks is not None:
        c = dset.chunks[depth_axis]
        step = max(c, step // c * c)  # whole chunks: each is decompressed once
    for i in range(dset.shape[0]):
        for d in range(0, dset.shape[depth_axis], step):
            sel = list(full)
            sel[0] = slice(i, i + 1)
            sel[depth_axis] = slice(d, min(d + step, dset.shape[depth_axis]))
            yield tuple(sel)


def _check_one(args: tuple[str, SampleSpec, bool]) -> tuple[str, list[str]]:
    path, spec, deep = args
    return path, check_file(path, spec, deep)


def check_files(source: str | os.PathLike | Sequence[str | os.PathLike], spec: SampleSpec,
                deep: bool = True, workers: int = 1, progress: bool = False) -> list[tuple[Path, str]]:
    """Check every sample file of ``source``; ``(file, reason)`` for each problem found.

    Files are listed from the directory itself (not its manifest), so stray or
    unlisted files are checked too; a manifest entry without a file is a problem.
    """
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        root = Path(source)
        files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix in (".h5", ".hdf5"))
        listed = sample_files(root)
        missing = [p for p in listed if not p.exists()]
    else:
        files, missing = sample_files(source), []
    problems: list[tuple[Path, str]] = [(p, "listed in the manifest but missing") for p in missing]
    jobs = [(str(p), spec, deep) for p in files]
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            results = list(_progress(pool.map(_check_one, jobs, chunksize=4), len(jobs), progress))
    else:
        results = list(_progress(map(_check_one, jobs), len(jobs), progress))
    for path, reasons in results:
        problems.extend((Path(path), r) for r in reasons)
    return problems


def _progress(it: Iterator, total: int, enabled: bool) -> Iterator:
    if not enabled:
        return it
    from tqdm import tqdm

    return tqdm(it, total=total, desc="check", unit="file")
