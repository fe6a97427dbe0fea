"""What a read costs: bytes HDF5 pulls from the file for a hyperslab.

``read_bytes`` is the reader's estimate without touching the file system (stored sizes of
the chunks a filtered hyperslab touches; the selected voxels of an unfiltered one, which
HDF5 reads in place with the chunk cache off); ``CountingFile`` measures instead, by
counting every byte HDF5 asks of a Python file object (metadata included).
"""

from __future__ import annotations

import io
import itertools
import os
from typing import Any, Sequence

import h5py
import numpy as np


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
        return selection_bytes(dset, selection)
    ranges = []
    for s, c, n in zip(selection, dset.chunks, dset.shape):
        ranges.append(range((s.start // c) * c, min(s.stop, n), c))
    total = 0
    for offset in itertools.product(*ranges):
        info = dset.id.get_chunk_info_by_coord(offset)
        total += int(info.size or 0)  # unwritten chunks are fill, read from nowhere
    return total


def selection_bytes(dset: h5py.Dataset, selection: Sequence[slice]) -> int:
    """Bytes of the voxels a hyperslab selects."""
    return int(np.prod([s.stop - s.start for s in selection])) * dset.dtype.itemsize


def read_bytes(dset: h5py.Dataset, selection: Sequence[slice]) -> int:
    """The bytes HDF5 reads from the file for a hyperslab with the chunk cache off.

    A filtered chunk must be read and decoded whole; an unfiltered one is read in place,
    only the selected runs (``tests/unit/test_data_crops.py`` checks this against a counting file).
    """
    if dset.chunks is None or dset.id.get_create_plist().get_nfilters() == 0:
        return selection_bytes(dset, selection)
    return touched_chunk_bytes(dset, selection)


