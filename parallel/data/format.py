"""The sample file format: field specs, chunk shapes that tile block boundaries, writing.

Every field is stored with a leading sample axis, so a file holds one sample (N = 1) or
many. A volume field is ``(N, C, D, H, W)`` (or ``(N, D, H, W)`` when it has no channel
axis, like a label map); a scalar field is ``(N, *shape)``. Volume chunks are
``(1, C, cd, ch, cw)`` with ``cd``, ``ch``, ``cw`` dividing every block boundary of the
spatial splits recorded in the file's ``splits`` attribute, so a block read touches its
own chunks only. Files written for training crops (``crop=``) instead get small chunks
sized to the crop's blocks (``choose_crop_chunks``): a crop lands anywhere in the case, so
no chunk grid can tile its blocks. See ``docs/data.md``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import h5py
import numpy as np

from parallel.data.codecs import codec_kwargs
from parallel.partition import DIM_NAMES, block_bounds

log = logging.getLogger(__name__)

FORMAT_NAME = "spatialcnn-sample"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SUFFIXES = (".h5", ".hdf5")
DEFAULT_CHUNK_BYTES = 1 << 20
UNCOMPRESSED_CHUNK_BYTES = 4 << 20
MIN_CHUNK_EDGE = 8


@dataclass(frozen=True)
class FieldSpec:
    """One dataset of a sample file.

    ``kind="volume"``: per sample ``(channels, D, H, W)``, or ``(D, H, W)`` when
    ``channels`` is None; each rank reads its block. ``kind="scalar"``: per sample
    ``shape``, read whole by every rank. ``finite``: every value must be finite;
    ``valid_range``: every value must lie in ``[lo, hi]`` (e.g. label classes).
    """

    name: str
    dtype: str
    kind: str = "volume"
    channels: int | None = None
    shape: tuple[int, ...] = ()
    finite: bool = False
    valid_range: tuple[float, float] | None = None

    def sample_shape(self, volume: Sequence[int]) -> tuple[int, ...]:
        """The per-sample shape of this field for a volume of ``(D, H, W)``."""
        if self.kind == "scalar":
            return tuple(self.shape)
        return ((self.channels,) if self.channels is not None else ()) + tuple(volume)


@dataclass(frozen=True)
class SampleSpec:
    """The fields of one kind of sample (a model family's dataset).

    ``checks``: module-level functions ``(open h5py.File, deep) -> [problem, ...]`` that
    ``check_file`` runs after the per-field checks, for what relates fields to each other
    (e.g. stored foreground boxes against the label map).
    """

    name: str
    fields: tuple[FieldSpec, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)
    checks: tuple[Callable[[Any, bool], list[str]], ...] = ()

    def __getitem__(self, name: str) -> FieldSpec:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"sample spec {self.name!r} has no field {name!r} (fields: {self.names})")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @property
    def volume_fields(self) -> tuple[FieldSpec, ...]:
        return tuple(f for f in self.fields if f.kind == "volume")


def _gcd_of_boundaries(n: int, splits: Iterable[int]) -> int:
    """The largest edge that divides every block boundary of ``n`` split each way."""
    cuts = [n]
    for parts in splits:
        cuts.extend(stop for _, stop in block_bounds(n, parts))
    return reduce(math.gcd, cuts)


def choose_chunks(volume: Sequence[int], splits: Sequence[Sequence[int]], channels: int | None,
                  itemsize: int, target_bytes: int = DEFAULT_CHUNK_BYTES, uncompressed: bool = False
                  ) -> tuple[int, ...]:
    """A chunk shape (with leading sample axis) whose edges tile every split's blocks.

    Along each dim the edge starts at the gcd of all block boundaries of ``splits``; the
    largest edge is halved (keeping it a divisor) while the chunk exceeds ``target_bytes``.
    ``uncompressed``: chunks of up to ``UNCOMPRESSED_CHUNK_BYTES``, halved along D first,
    then H: a codec decodes whole chunks (small ones suit it), but an unfiltered chunk is
    read as its runs in the block, which are long where the chunk keeps H and W whole
    (``parallel.data.direct``).
    Where uneven splits leave a gcd below both ``MIN_CHUNK_EDGE`` and the smallest block,
    no sensible chunk tiles the boundaries: the edge becomes ``MIN_CHUNK_EDGE`` and a block read may touch one extra
    chunk layer at that boundary (logged).
    """
    splits = [tuple(int(s) for s in sp) for sp in splits] or [(1, 1, 1)]
    edges = []
    for axis, n in enumerate(volume):
        parts = [sp[axis] for sp in splits]
        g = _gcd_of_boundaries(int(n), parts)
        smallest = min(int(n) // p for p in parts)
        if g < min(MIN_CHUNK_EDGE, smallest):
            log.warning("dim %s of %d voxels: the block boundaries of splits %s share no edge "
                        ">= %d; block reads will touch a neighbour's chunk layer there",
                        DIM_NAMES[axis], n, splits, MIN_CHUNK_EDGE)
            g = min(MIN_CHUNK_EDGE, int(n))
        edges.append(g)
    per_voxel = itemsize * (channels or 1)
    if uncompressed:
        target_bytes = max(target_bytes, UNCOMPRESSED_CHUNK_BYTES)
    while math.prod(edges) * per_voxel > target_bytes:
        if uncompressed:  # D first, then H, then W: long contiguous runs
            axis = next((a for a in range(3) if edges[a] % 2 == 0 and edges[a] > MIN_CHUNK_EDGE), None)
            if axis is None:
                break
        else:
            axis = max(range(3), key=lambda a: edges[a])
            if edges[axis] % 2 or edges[axis] <= MIN_CHUNK_EDGE:
                break
        edges[axis] //= 2
    return (1,) + ((channels,) if channels is not None else ()) + tuple(edges)


def choose_crop_chunks(volume: Sequence[int], crop: Sequence[int], splits: Sequence[Sequence[int]],
                       channels: int | None, codec: str = "none") -> tuple[int, ...]:
    """A chunk shape (with leading sample axis) for reading blocks of crops at any offset.

    A block of ``L`` voxels along a dim at a random offset touches about ``L + c - 1``
    voxels of chunks of edge ``c``. A codec decodes whole chunks, so there the edge sets
    the overhead (about ``c / L`` per dim): the largest power of two at most ``L / 8``,
    within [8, 32]. Unfiltered chunks are read in place (only the block's voxels), so the
    edge only sets the size of the chunk index, which is read too: the largest power of
    two at most ``L / 2``, within [8, 64]. ``L`` is the smallest block of the crop over
    ``splits`` along the dim (crop 128 split 2: 64, so edges 8 with a codec, 32 without).
    """
    splits = [tuple(int(s) for s in sp) for sp in splits] or [(1, 1, 1)]
    share, top = (8, 32) if codec != "none" else (2, 64)
    edges = []
    for axis, (n, c) in enumerate(zip(volume, crop)):
        block = max(int(c) // max(sp[axis] for sp in splits), 1)
        edge = 1 << max((block // share).bit_length() - 1, 0)
        edges.append(max(1, min(max(edge, MIN_CHUNK_EDGE), top, int(n))))
    return (1,) + ((channels,) if channels is not None else ()) + tuple(edges)


def sample_files(source: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """The sample files of a directory (sorted, manifest order first) or a list of files."""
    if isinstance(source, (str, os.PathLike)):
        root = Path(source)
        if root.is_file():
            return [root]
        if not root.is_dir():
            raise FileNotFoundError(f"no sample directory or file at {root}")
        manifest = read_manifest(root)
        if manifest is not None:
            return [root / entry["name"] for entry in manifest["files"]]
        return sorted(p for p in root.iterdir() if p.suffix in SUFFIXES and p.is_file())
    return [Path(p) for p in source]


def read_manifest(root: Path) -> dict[str, Any] | None:
    """The directory's manifest (file names and sample counts), or None if it has none."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def write_manifest(root: str | os.PathLike, spec_name: str | None = None,
                   counts: Mapping[str, int] | None = None, **extra: Any) -> Path:
    """Record every sample file of ``root`` with its sample count.

    ``counts`` (file name -> samples) saves opening each file, which matters for
    hundreds of thousands of files; files it does not list are opened.
    """
    root = Path(root)
    files = sorted(p for p in root.iterdir() if p.suffix in SUFFIXES and p.is_file())
    entries = []
    for path in files:
        if counts is not None and path.name in counts:
            entries.append({"name": path.name, "samples": int(counts[path.name])})
            continue
        with h5py.File(path, "r") as f:
            entries.append({"name": path.name, "samples": int(f.attrs.get("samples", 1))})
    manifest = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "spec": spec_name,
                "files": entries, **extra}
    tmp = root / (MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=1)
    os.replace(tmp, root / MANIFEST)
    return root / MANIFEST


def write_samples(path: str | os.PathLike, spec: SampleSpec, arrays: Mapping[str, np.ndarray],
                  splits: Sequence[Sequence[int]] = ((1, 1, 1),), codec: str = "none",
                  attrs: Mapping[str, Any] | None = None,
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES, crop: Sequence[int] | None = None) -> Path:
    """Write ``arrays`` (each with a leading sample axis) as one sample file, atomically.

    The file is written to ``path + ".tmp"`` and renamed, so an interrupted run never
    leaves a partial file under the final name (converters resume by skipping outputs).
    ``crop``: chunk for training crops of this size (``choose_crop_chunks``) instead of
    for whole-case blocks.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with h5py.File(tmp, "w") as f:
        create_datasets(f, spec, {k: (a.shape, a.dtype) for k, a in arrays.items()},
                        splits, codec, attrs, chunk_bytes, crop)
        for name, array in arrays.items():
            f[name][...] = array
    os.replace(tmp, path)
    return path


def create_datasets(f: h5py.File, spec: SampleSpec, shapes: Mapping[str, tuple[Sequence[int], Any]],
                    splits: Sequence[Sequence[int]], codec: str = "none",
                    attrs: Mapping[str, Any] | None = None,
                    chunk_bytes: int = DEFAULT_CHUNK_BYTES, crop: Sequence[int] | None = None) -> None:
    """Create the (empty) datasets and attributes of a sample file, to be filled in slabs.

    ``crop``: chunk volume fields for training crops of this size (else for blocks).
    """
    samples = None
    volume = None
    for fs in spec.fields:
        if fs.name not in shapes:
            raise KeyError(f"{f.filename}: field {fs.name!r} of spec {spec.name!r} is missing")
        shape, dtype = shapes[fs.name]
        shape = tuple(int(s) for s in shape)
        if samples is None:
            samples = shape[0]
        if shape[0] != samples:
            raise ValueError(f"{f.filename}: field {fs.name!r} has {shape[0]} samples, "
                             f"the first field has {samples}")
        if np.dtype(dtype) != np.dtype(fs.dtype):
            raise TypeError(f"{f.filename}: field {fs.name!r} is {np.dtype(dtype)}, spec wants {fs.dtype}")
        if fs.kind == "volume":
            volume = shape[-3:]
            if shape[1:] != fs.sample_shape(volume):
                raise ValueError(f"{f.filename}: field {fs.name!r} has sample shape {shape[1:]}, "
                                 f"spec wants {fs.sample_shape(volume)}")
            if crop is not None:
                chunks = choose_crop_chunks(volume, crop, splits, fs.channels, codec)
            else:
                chunks = choose_chunks(volume, splits, fs.channels, np.dtype(fs.dtype).itemsize, chunk_bytes,
                                       uncompressed=(codec or "none").lower() == "none")
            f.create_dataset(fs.name, shape=shape, dtype=fs.dtype, chunks=chunks, **codec_kwargs(codec))
        else:
            if shape[1:] != tuple(fs.shape):
                raise ValueError(f"{f.filename}: field {fs.name!r} has sample shape {shape[1:]}, "
                                 f"spec wants {tuple(fs.shape)}")
            f.create_dataset(fs.name, shape=shape, dtype=fs.dtype)
    f.attrs["format"] = FORMAT_NAME
    f.attrs["version"] = FORMAT_VERSION
    f.attrs["spec"] = spec.name
    f.attrs["samples"] = int(samples or 0)
    f.attrs["splits"] = np.asarray([tuple(sp) for sp in splits] or [(1, 1, 1)], dtype=np.int64)
    f.attrs["codec"] = codec
    if crop is not None:
        f.attrs["chunked_for_crop"] = np.asarray([int(c) for c in crop], dtype=np.int64)
    if volume is not None:
        f.attrs["global_shape"] = np.asarray(volume, dtype=np.int64)
        f.attrs["block_origin"] = np.zeros(3, dtype=np.int64)
    for key, value in {**spec.attrs, **(attrs or {})}.items():
        f.attrs[key] = value


def parse_splits(text: str | Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    """``"2,4,2x2x1"`` -> ``[(2,1,1), (4,1,1), (2,2,1)]`` (a bare number splits depth)."""
    if not isinstance(text, str):
        return [tuple(int(s) for s in sp) for sp in text]  # type: ignore[misc]
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        parts = [int(p) for p in item.lower().split("x")]
        if len(parts) > 3 or any(p < 1 for p in parts):
            raise ValueError(f"bad spatial split {item!r}: want D, DxH or DxHxW with positive ints")
        out.append(tuple(parts + [1] * (3 - len(parts))))
    return out or [(1, 1, 1)]
