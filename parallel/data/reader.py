"""The block dataset: each rank reads the hyperslab of its block, never the whole sample.

Files are opened lazily in the process that reads (each DataLoader worker opens its own
handles), and every read is accounted: the bytes of the chunks the hyperslab touches
(their stored, i.e. compressed, sizes) and the seconds spent. ``io="counting"`` opens
files through a Python file object that counts every byte HDF5 actually reads
(metadata included), for tests and benchmarks.
"""

from __future__ import annotations

import io
import itertools
import logging
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

import h5py
import numpy as np
import torch

import parallel.data.codecs  # noqa: F401  (registers the HDF5 compression filters)
from parallel.data.format import read_manifest, sample_files

log = logging.getLogger(__name__)

Sample = dict[str, torch.Tensor]
Transform = Callable[[Sample], Sample]


class SampleReadError(RuntimeError):
    """A sample file could not be read; the message names the file, field and sample."""


class CountingFile(io.RawIOBase):
    """A read-only file whose ``bytes_read`` counts every byte handed to the reader."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self._fh = open(path, "rb", buffering=0)
        self.bytes_read = 0

    def readinto(self, buffer: Any) -> int:
        n = self._fh.readinto(buffer)
        self.bytes_read += n or 0
        return n

    def read(self, size: int = -1) -> bytes:
        data = self._fh.read(size)
        self.bytes_read += len(data)
        return data

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._fh.seek(offset, whence)

    def tell(self) -> int:
        return self._fh.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        self._fh.close()
        super().close()


def touched_chunk_bytes(dset: h5py.Dataset, selection: Sequence[slice]) -> int:
    """Stored bytes of the chunks that a hyperslab (one slice per dim) intersects.

    For a contiguous dataset, the bytes of the selection itself.
    """
    if dset.chunks is None:
        return int(np.prod([s.stop - s.start for s in selection])) * dset.dtype.itemsize
    ranges = []
    for s, c, n in zip(selection, dset.chunks, dset.shape):
        ranges.append(range((s.start // c) * c, min(s.stop, n), c))
    total = 0
    for offset in itertools.product(*ranges):
        info = dset.id.get_chunk_info_by_coord(offset)
        total += int(info.size or 0)  # unwritten chunks are fill, read from nowhere
    return total


class BlockDataset(torch.utils.data.Dataset):
    """A rank's view of sample files: volume fields as its block, scalar fields whole.

    Args:
        source: a directory of sample files (its ``manifest.json`` order when present), a
            file, or a list of files.
        fields: the datasets to read (default: every dataset of the first file).
        grid: the process grid; its ``block_range`` decides the hyperslab. None reads
            whole volumes (serial).
        transform: applied to each sample's dict of tensors, on the block, in the worker.
        io: ``"native"`` (HDF5's own driver; bytes = touched chunks' stored size) or
            ``"counting"`` (a counting Python file object; bytes = all bytes HDF5 read).
        max_open_files: open handles kept per process (least recently used closed first).
    """

    def __init__(self, source: str | os.PathLike | Sequence[str | os.PathLike],
                 fields: Sequence[str] | None = None, grid: Any = None,
                 transform: Transform | None = None, io: Literal["native", "counting"] = "native",
                 max_open_files: int = 64) -> None:
        self.grid = grid
        self.transform = transform
        self.io = io
        self.max_open_files = max_open_files
        self.files, counts, self._fallback = _resolve(source, grid)
        if not self.files:
            raise FileNotFoundError(f"no sample files (*.h5, *.hdf5) in {source}")
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._starts = starts
        self._volume_fields: set[str] = set()
        path = self._path(0)
        try:
            with h5py.File(path, "r") as f:
                self.fields = tuple(fields) if fields is not None else tuple(
                    k for k in f.keys() if isinstance(f[k], h5py.Dataset))
                global_shape = _global_shape(f)
                for name in self.fields:
                    if name not in f:
                        raise KeyError(f"{path}: has no field {name!r} (fields: {list(f.keys())})")
                    if global_shape is not None and f[name].ndim >= 4:
                        self._volume_fields.add(name)
                self.attrs = {k: _plain(v) for k, v in f.attrs.items()}
        except OSError as err:
            raise SampleReadError(f"{path}: cannot open sample file: {err}") from err
        self._handles: OrderedDict[Path, tuple[h5py.File, CountingFile | None]] = OrderedDict()
        self._pid = os.getpid()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def locate(self, index: int) -> tuple[Path, int]:
        """The file that holds global sample ``index`` and the sample's row in it."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} outside a dataset of {len(self)}")
        i = int(np.searchsorted(self._starts, index, side="right") - 1)
        return self._path(i), int(index - self._starts[i])

    def _path(self, i: int) -> Path:
        path = self.files[i]
        if self._fallback is not None and not path.exists():
            log.debug("%s is not staged; reading %s", path, self._fallback[i])
            return self._fallback[i]
        return path

    def __getitem__(self, index: int) -> Sample:
        return self.load(index)[0]

    def load(self, index: int) -> tuple[Sample, int, float]:
        """The sample's dict of tensors, the bytes read and the seconds spent reading."""
        path, row = self.locate(index)
        t0 = time.perf_counter()
        opened = path not in self._handles or self._pid != os.getpid()
        f, counter = self._open(path)
        # A fresh handle has read the superblock and headers already: count them too.
        before = 0 if opened or counter is None else counter.bytes_read
        sample: Sample = {}
        nbytes = 0
        for name in self.fields:
            selection: tuple[slice, ...] = ()
            try:
                dset = f[name]
                if name in self._volume_fields:
                    selection = self._selection(f, dset, row)
                    if counter is None:
                        nbytes += touched_chunk_bytes(dset, selection)
                    array = dset[selection][0]
                else:
                    array = dset[row]
                    if counter is None:
                        nbytes += int(np.asarray(array).nbytes)
            except (OSError, KeyError, ValueError) as err:
                where = f" hyperslab {[(s.start, s.stop) for s in selection]}" if selection else ""
                raise SampleReadError(f"{path}: field {name!r} sample {row}{where}: {err}") from err
            sample[name] = torch.from_numpy(np.ascontiguousarray(array))
        seconds = time.perf_counter() - t0
        if counter is not None:
            nbytes = counter.bytes_read - before
        if self.transform is not None:
            sample = self.transform(sample)
        return sample, nbytes, seconds

    def _selection(self, f: h5py.File, dset: h5py.Dataset, row: int) -> tuple[slice, ...]:
        shape = _global_shape(f)
        stored = dset.shape[-3:]
        assert shape is not None
        origin = tuple(int(o) for o in f.attrs.get("block_origin", (0, 0, 0)))
        if self.grid is None:
            ranges = tuple((0, n) for n in shape)
        else:
            ranges = self.grid.block_range(shape)
        local = []
        for axis, ((a, b), o, n) in enumerate(zip(ranges, origin, stored)):
            if a - o < 0 or b - o > n:
                raise SampleReadError(
                    f"{f.filename}: field {dset.name.lstrip('/')!r} holds [{o}, {o + n}) of dim "
                    f"{'DHW'[axis]} of a {tuple(shape)} volume, but this rank's block is [{a}, {b})")
            local.append(slice(a - o, b - o))
        lead = [slice(row, row + 1)] + [slice(0, n) for n in dset.shape[1:-3]]
        return tuple(lead + local)

    def _open(self, path: Path) -> tuple[h5py.File, CountingFile | None]:
        if self._pid != os.getpid():  # inherited from a parent by fork: never share handles
            self._handles = OrderedDict()
            self._pid = os.getpid()
        entry = self._handles.get(path)
        if entry is not None:
            self._handles.move_to_end(path)
            return entry
        try:
            if self.io == "counting":
                counter = CountingFile(path)
                f = h5py.File(counter, "r")
            else:
                counter = None
                # Chunks are read once per sample: a cache would only copy them again.
                f = h5py.File(path, "r", rdcc_nbytes=0)
        except OSError as err:
            raise SampleReadError(f"{path}: cannot open sample file: {err}") from err
        self._handles[path] = (f, counter)
        while len(self._handles) > self.max_open_files:
            _, (old, old_counter) = self._handles.popitem(last=False)
            old.close()
            if old_counter is not None:
                old_counter.close()
        return f, counter

    def close(self) -> None:
        """Close every open handle of this process."""
        for f, counter in self._handles.values():
            f.close()
            if counter is not None:
                counter.close()
        self._handles.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handles"] = OrderedDict()  # h5py handles never cross processes
        return state


def _global_shape(f: h5py.File) -> tuple[int, int, int] | None:
    shape = f.attrs.get("global_shape")
    if shape is not None:
        return tuple(int(s) for s in shape)  # type: ignore[return-value]
    for key in f.keys():
        obj = f[key]
        if isinstance(obj, h5py.Dataset) and obj.ndim >= 4:
            return tuple(obj.shape[-3:])  # type: ignore[return-value]
    return None


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _resolve(source: str | os.PathLike | Sequence[str | os.PathLike], grid: Any
             ) -> tuple[list[Path], list[int], list[Path] | None]:
    """Files, samples per file and (for a staged directory) the shared-storage fallbacks."""
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        root = Path(source)
        manifest = read_manifest(root)
        if manifest is not None and manifest.get("staged"):
            names = [e["name"] for e in manifest["files"]]
            counts = [int(e["samples"]) for e in manifest["files"]]
            local = root
            if manifest.get("blocks"):
                coords = grid.coords if grid is not None else (0, 0, 0)
                local = root / block_dir_name(coords)
            fallback = [Path(manifest["source"]) / n for n in names]
            return [local / n for n in names], counts, fallback
        if manifest is not None:
            return ([root / e["name"] for e in manifest["files"]],
                    [int(e["samples"]) for e in manifest["files"]], None)
    files = sample_files(source)
    counts = []
    for path in files:
        try:
            with h5py.File(path, "r") as f:
                counts.append(int(f.attrs.get("samples", _first_len(f))))
        except OSError as err:
            raise SampleReadError(f"{path}: cannot open sample file: {err}") from err
    return files, counts, None


def _first_len(f: h5py.File) -> int:
    for key in f.keys():
        if isinstance(f[key], h5py.Dataset):
            return int(f[key].shape[0])
    raise SampleReadError(f"{f.filename}: holds no datasets")


def block_dir_name(coords: Sequence[int]) -> str:
    """The staging subdirectory holding the blocks at spatial ``coords``."""
    cd, ch, cw = coords
    return f"block_d{cd}h{ch}w{cw}"


def as_float(sample: Mapping[str, torch.Tensor], names: Sequence[str]) -> Sample:
    """A copy of ``sample`` with ``names`` cast to float32 (helper for transforms)."""
    out = dict(sample)
    for n in names:
        out[n] = out[n].float()
    return out
