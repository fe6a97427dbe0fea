"""The block dataset: each rank reads the hyperslab of its block, never the whole sample.

Files are opened lazily in the process that reads (each DataLoader worker opens its own
handles), and every read is accounted: the bytes HDF5 reads for the hyperslab (for a
filtered, i.e. compressed, dataset the stored sizes of the chunks it touches; for an
unfiltered one just the selected voxels, which HDF5 reads straight from the file when
the chunk cache is off, as here) and the seconds spent. An unfiltered hyperslab of whole
chunks (a block of a file chunked to tile the blocks) is read chunk by chunk with plain
reads into the output array instead (``parallel.data.direct``: HDF5 would copy it in
runs as short as a chunk's rows). ``io="counting"`` opens files
through a Python file object that counts every byte HDF5 actually reads (metadata
included), for tests and benchmarks.

Samples may differ in shape: each file's ``global_shape`` says its case's (D, H, W). With
a region policy (``parallel.data.crops``: training crops, evaluation boxes) a rank reads
its block of the sample's region instead of its block of the whole case, padding
materialised locally where the region leaves the case; the region is chosen per
(sample, epoch), so the dataset takes keys ``(index, epoch)`` as well as plain indices.
"""

from __future__ import annotations

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
from parallel.data import direct
from parallel.data.accounting import CountingFile, read_bytes, selection_bytes, touched_chunk_bytes  # noqa: F401
from parallel.data.crops import REGION_KEY, Region, RegionPolicy
from parallel.data.format import read_manifest, sample_files

log = logging.getLogger(__name__)

Sample = dict[str, torch.Tensor]
Transform = Callable[[Sample], Sample]
Key = int | tuple[int, int]
"""A sample index, or ``(index, epoch)`` when the region depends on the epoch (crops)."""


class SampleReadError(RuntimeError):
    """A sample file could not be read; the message names the file, field and sample."""


def _key(key: Key) -> tuple[int, int]:
    if isinstance(key, (tuple, list)):
        return int(key[0]), int(key[1])
    return int(key), 0


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
        regions: a region policy (``parallel.data.crops``): each sample's volume fields
            come back as this rank's block of the sample's region (a crop), and the
            sample carries ``REGION_KEY``. None: the block of the whole case.
    """

    def __init__(self, source: str | os.PathLike | Sequence[str | os.PathLike],
                 fields: Sequence[str] | None = None, grid: Any = None,
                 transform: Transform | None = None, io: Literal["native", "counting"] = "native",
                 max_open_files: int = 64, regions: RegionPolicy | None = None) -> None:
        self.grid = grid
        self.transform = transform
        self.io = io
        self.max_open_files = max_open_files
        self.regions = regions
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
                    if global_shape is not None and _is_volume(f, f[name]):
                        self._volume_fields.add(name)
                self.attrs = {k: _plain(v) for k, v in f.attrs.items()}
        except OSError as err:
            raise SampleReadError(f"{path}: cannot open sample file: {err}") from err
        self._handles: OrderedDict[Path, tuple[h5py.File, CountingFile | None]] = OrderedDict()
        self._fds: dict[Path, int] = {}
        # Per open file: its datasets and each block's hyperslab and read path, looked up
        # once while the handle stays open (h5py's lookups and attribute reads cost ~0.5 ms
        # a sample, a sixth of a 256^3 2x2x2 block read); dropped with the handle.
        self._memo: dict[Path, dict[Any, Any]] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def locate(self, index: Key) -> tuple[Path, int]:
        """The file that holds global sample ``index`` and the sample's row in it."""
        index = _key(index)[0]
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

    def __getitem__(self, index: Key) -> Sample:
        return self.load(index)[0]

    def load(self, key: Key) -> tuple[Sample, int, float]:
        """The sample's dict of tensors, the bytes read and the seconds spent reading.

        ``key``: the sample index, or ``(index, epoch)`` (the epoch seeds a crop).
        """
        index, epoch = _key(key)
        path, row = self.locate(index)
        t0 = time.perf_counter()
        opened = path not in self._handles or self._pid != os.getpid()
        f, counter = self._open(path)
        # A fresh handle has read the superblock and headers already: count them too.
        before = 0 if opened or counter is None else counter.bytes_read
        sample: Sample = {}
        nbytes = 0
        region = None
        if self.regions is not None:
            region, nbytes = self._region(f, path, row, index, epoch)
        memo = self._memo.setdefault(path, {})
        for name in self.fields:
            selection: tuple[slice, ...] = ()
            try:
                dset = memo.get(name)
                if dset is None:
                    dset = memo[name] = f[name]
                if name in self._volume_fields:
                    plan = memo.get((name, row)) if region is None else None
                    if plan is None:
                        selection, takes = self._selection(f, dset, row, region)
                        plan = (selection, takes, counter is None and direct.applies(dset, selection))
                        if region is None:
                            memo[(name, row)] = plan
                    selection, takes, direct_read = plan
                    if direct_read:
                        whole, n = direct.read(dset, selection, self._fd(path))
                        nbytes += n
                        array = _take(whole[0], takes)
                    else:
                        if counter is None:
                            nbytes += read_bytes(dset, selection)
                        array = _take(dset[selection][0], takes)
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
        if region is not None:
            sample[REGION_KEY] = region.as_tensor()
        if self.transform is not None:
            sample = self.transform(sample)
        return sample, nbytes, seconds

    def _region(self, f: h5py.File, path: Path, row: int, index: int, epoch: int) -> tuple[Region | None, int]:
        """The policy's region for the sample, and the bytes of the scalars it read."""
        assert self.regions is not None
        shape = _global_shape(f)
        if shape is None:
            raise SampleReadError(f"{path}: no global_shape attribute and no volume field: cannot place a region")
        scalars, nbytes = {}, 0
        for name in self.regions.fields:
            if name not in f:
                raise SampleReadError(
                    f"{path}: has no field {name!r}, which the training crop needs (files converted before "
                    f"crops existed: convert them again, or set the oversampling to 0)")
            try:
                scalars[name] = np.asarray(f[name][row])
            except (OSError, ValueError) as err:
                raise SampleReadError(f"{path}: field {name!r} sample {row}: {err}") from err
            nbytes += scalars[name].nbytes
        return self.regions.region(index, epoch, shape, scalars), nbytes

    def _selection(self, f: h5py.File, dset: h5py.Dataset, row: int, region: Region | None = None
                   ) -> tuple[tuple[slice, ...], list[np.ndarray | None]]:
        """The hyperslab to read and, per dim, the indices to take from it (None: all).

        Without a region: this rank's block of the case. With one: this rank's block of
        the region, clamped to the case; where the region leaves the case the take
        repeats the border voxel (edge padding), on this rank only.
        """
        shape = _global_shape(f)
        stored = dset.shape[-3:]
        assert shape is not None
        origin = tuple(int(o) for o in f.attrs.get("block_origin", (0, 0, 0)))
        extent = region.size if region is not None else shape
        start = region.start if region is not None else (0, 0, 0)
        if self.grid is None:
            ranges = tuple((0, n) for n in extent)
        else:
            ranges = self.grid.block_range(extent)
        local, takes = [], []
        for axis, ((a, b), s0, o, n, full) in enumerate(zip(ranges, start, origin, stored, shape)):
            a, b = a + s0, b + s0
            take = None
            if a < 0 or b > full:  # the region leaves the case here: read the clamped run once
                idx = np.clip(np.arange(a, b), 0, full - 1)
                a, b = int(idx[0]), int(idx[-1]) + 1
                take = idx - a
            if a - o < 0 or b - o > n:
                raise SampleReadError(
                    f"{f.filename}: field {dset.name.lstrip('/')!r} holds [{o}, {o + n}) of dim "
                    f"{'DHW'[axis]} of a {tuple(shape)} volume, but this rank's block is [{a}, {b})")
            local.append(slice(a - o, b - o))
            takes.append(take)
        lead = [slice(row, row + 1)] + [slice(0, n) for n in dset.shape[1:-3]]
        return tuple(lead + local), takes

    def _fd(self, path: Path) -> int:
        """A plain descriptor of an open sample file, for ``direct`` reads (closed with its handle)."""
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def _open(self, path: Path) -> tuple[h5py.File, CountingFile | None]:
        if self._pid != os.getpid():  # inherited from a parent by fork: never share handles
            self._handles = OrderedDict()
            self._fds = {}
            self._memo = {}
            self._pid = os.getpid()
        entry = self._handles.get(path)
        if entry is not None:
            self._handles.move_to_end(path)
            return entry
        try:
            if self.io == "counting":
                counter = CountingFile(path)
                f = h5py.File(counter, "r", rdcc_nbytes=0)
            else:
                counter = None
                # Chunks are read once per sample: a cache would only copy them again.
                f = h5py.File(path, "r", rdcc_nbytes=0)
        except OSError as err:
            raise SampleReadError(f"{path}: cannot open sample file: {err}") from err
        self._handles[path] = (f, counter)
        while len(self._handles) > self.max_open_files:
            old_path, (old, old_counter) = self._handles.popitem(last=False)
            self._memo.pop(old_path, None)
            old.close()
            if old_counter is not None:
                old_counter.close()
            if old_path in self._fds:
                os.close(self._fds.pop(old_path))
        return f, counter

    def close(self) -> None:
        """Close every open handle of this process."""
        for f, counter in self._handles.values():
            f.close()
            if counter is not None:
                counter.close()
        self._handles.clear()
        self._memo.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handles"] = OrderedDict()  # h5py handles never cross processes
        state["_fds"] = {}
        state["_memo"] = {}
        return state


def _take(array: np.ndarray, takes: Sequence[np.ndarray | None]) -> np.ndarray:
    """Apply the per-dim index lists of ``_selection`` to the last three dims."""
    for axis, take in enumerate(takes):
        if take is not None:
            array = np.take(array, take, axis=array.ndim - 3 + axis)
    return array


def _is_volume(f: h5py.File, dset: h5py.Dataset) -> bool:
    """Whether a dataset is a volume field (read per block): its last three dims span the
    volume the file stores (the case, or a staged block: attribute ``block_shape``)."""
    if dset.ndim < 4:
        return False
    extent = f.attrs.get("block_shape")
    if extent is None:
        if np.asarray(f.attrs.get("block_origin", (0, 0, 0))).any():
            return True  # a block staged before blocks recorded their shape
        extent = _global_shape(f)
    return extent is None or tuple(dset.shape[-3:]) == tuple(int(n) for n in extent)


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
