"""Block reads of unfiltered chunks straight from the file, at the storage's speed.

HDF5 reads an unfiltered chunk "in place": with the chunk cache off it copies each
contiguous run the selection makes in memory with its own read, so a 1 MiB chunk of
(4, 32, 64, 64) int16 voxels read into a larger block costs 8192 reads of 128 bytes; a
256^3 block read this way ran at ~1% of a sequential read of the file (measured,
docs/performance.md). Here the reader asks HDF5 only where each chunk lies
(``get_chunk_info_by_coord``) and reads it itself: one ``preadv`` straight into the
output array's contiguous runs where they are long, else one read of the whole chunk
into a reused staging buffer and one copy into place. Only hyperslabs made of whole
chunks (block reads of files chunked to tile the blocks) take this path; the bytes read
are exactly the chunks' stored bytes.
"""

from __future__ import annotations

import itertools
import os
from typing import Sequence

import h5py
import numpy as np

MIN_RUN_BYTES = 16 << 10
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024


def applies(dset: h5py.Dataset, selection: Sequence[slice]) -> bool:
    """Whether ``selection`` of ``dset`` can be read chunk by chunk (unfiltered, chunked,
    native byte order, every slice on chunk boundaries or the dataset's end)."""
    if dset.chunks is None or dset.id.get_create_plist().get_nfilters() or not dset.dtype.isnative:
        return False
    for s, c, n in zip(selection, dset.chunks, dset.shape):
        if s.start % c or (s.stop % c and s.stop != n):
            return False
    return True


def _pread(fd: int, buffers: list[memoryview], offset: int) -> int:
    """``preadv`` of all ``buffers`` from ``offset`` (in groups the kernel accepts); bytes read."""
    total = 0
    for i in range(0, len(buffers), _IOV_MAX):
        group = buffers[i:i + _IOV_MAX]
        want = sum(b.nbytes for b in group)
        got = os.preadv(fd, group, offset + total)
        if got != want:  # a short read (end of file, or a signal): the caller falls back
            return total + got
        total += got
    return total


def _runs(dst: np.ndarray, whole: np.ndarray) -> list[memoryview] | None:
    """``dst`` (a box of the C-contiguous ``whole``) as contiguous byte runs in C order, or
    None where they would be shorter than ``MIN_RUN_BYTES``."""
    k = dst.ndim - 1
    while k > 0 and dst.shape[k] == whole.shape[k]:
        k -= 1  # trailing dims taken whole merge into one run
    run = int(np.prod(dst.shape[k:])) * dst.itemsize
    if run < MIN_RUN_BYTES and dst.size * dst.itemsize > run:
        return None
    return [memoryview(dst[idx]).cast("B") for idx in np.ndindex(*dst.shape[:k])] if k else \
        [memoryview(dst).cast("B")]


def read(dset: h5py.Dataset, selection: Sequence[slice], fd: int) -> tuple[np.ndarray, int]:
    """The hyperslab ``selection`` of ``dset`` (``applies`` must hold), read from the open
    file ``fd``; and the bytes read (the touched chunks' stored bytes)."""
    chunks = dset.chunks
    out = np.empty([s.stop - s.start for s in selection], dset.dtype)
    stage: np.ndarray | None = None
    nbytes = 0
    for corner in itertools.product(*(range(s.start, s.stop, c) for s, c in zip(selection, chunks))):
        box = tuple(slice(a - s.start, min(a + c, s.stop) - s.start) for a, s, c in zip(corner, selection, chunks))
        dst = out[box]
        info = dset.id.get_chunk_info_by_coord(corner)
        if info.byte_offset is None:  # never written: the fill value
            dst[...] = dset.fillvalue
            continue
        whole_chunk = all(b.stop - b.start == c for b, c in zip(box, chunks))
        runs = _runs(dst, out) if whole_chunk else None
        if runs is not None and _pread(fd, runs, info.byte_offset) == info.size:
            nbytes += info.size
            continue
        if stage is None:
            stage = np.empty(int(np.prod(chunks)), dset.dtype)
        buf = memoryview(stage).cast("B")[:info.size]
        if _pread(fd, [buf], info.byte_offset) != info.size:
            raise OSError(f"short read of chunk {corner} ({info.size} bytes at offset {info.byte_offset})")
        nbytes += info.size
        dst[...] = stage.reshape(chunks)[tuple(slice(0, b.stop - b.start) for b in box)]
    return out, nbytes
