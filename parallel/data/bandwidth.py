"""A shared file system with a bandwidth, for measurement: every process of the machine
draws the bytes it reads from one budget of ``rate`` bytes/s.

The budget lives in a small file (``path``) that every process opens: under an
``fcntl`` lock a draw of ``n`` bytes takes the storage from ``max(now - burst, free_at)``
to ``free_at = start + n / rate`` and adds ``n`` to the total; the caller then sleeps
until its bytes have "arrived" (``free_at``). ``burst`` seconds of idle storage are kept
as credit (a token bucket of ``burst * rate`` bytes): a reader woken late by a busy
scheduler does not lose the bandwidth it slept through, and over any span the bytes
served stay within ``rate * span + burst * rate``. Draws are served in the order they come, as one
storage channel of ``rate`` bytes/s serves its queue, so ``k`` ranks reading at once
each get ``rate / k``; large draws are cut into pieces of ``piece`` bytes so that
concurrent readers interleave. The file also counts every byte drawn (``total()``),
whichever process drew it: the benchmark's and the staging test's count of bytes read
from the "shared file system".

Only the benchmarks use it (``parallel.bench.wall``): training never reads through it.
The reader reads at the local disk's speed and then draws what it read (the reader's
own accounting of the bytes), so the limit must lie well below the disk's and the page
cache's bandwidth; a sleep costs no CPU, so the result holds on a loaded machine.
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
from pathlib import Path

_FORMAT = "<dq"  # free_at (seconds, time.time()), total bytes drawn
_SIZE = struct.calcsize(_FORMAT)


class SharedBandwidth:
    """``rate`` bytes/s shared by every process that opens ``path``.

    Picklable (a path and two numbers): each process opens the file on its first draw.
    """

    def __init__(self, path: str | os.PathLike, rate: float, piece: int = 4 << 20, burst: float = 0.1) -> None:
        if not rate > 0:
            raise ValueError(f"shared bandwidth: rate must be > 0 bytes/s, got {rate}")
        self.path = str(path)
        self.rate = float(rate)
        self.piece = int(piece)
        self.burst = float(burst)
        p = Path(self.path)
        if not p.exists() or p.stat().st_size != _SIZE:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")
            tmp.write_bytes(struct.pack(_FORMAT, 0.0, 0))
            os.replace(tmp, p)

    def _update(self, nbytes: int) -> float:
        """Book ``nbytes`` on the shared channel; the time (``time.time()``) they arrive."""
        with open(self.path, "r+b") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                free_at, total = struct.unpack(_FORMAT, fh.read(_SIZE))
                done = max(time.time() - self.burst, free_at) + nbytes / self.rate
                fh.seek(0)
                fh.write(struct.pack(_FORMAT, done, total + nbytes))
                fh.flush()
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
        return done

    def draw(self, nbytes: int) -> float:
        """Take ``nbytes`` from the shared budget, sleeping until they have arrived; the
        seconds slept."""
        slept = 0.0
        left = int(nbytes)
        while left > 0:
            n = min(left, self.piece)
            left -= n
            wait = self._update(n) - time.time()
            if wait > 0:
                time.sleep(wait)
                slept += wait
        return slept

    def total(self) -> int:
        """Bytes drawn by every process since the file was made (or ``reset``)."""
        with open(self.path, "rb") as fh:
            fcntl.flock(fh, fcntl.LOCK_SH)
            try:
                return int(struct.unpack(_FORMAT, fh.read(_SIZE))[1])
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def reset(self) -> None:
        """Zero the count and free the channel (between measurements, all processes idle)."""
        with open(self.path, "r+b") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                fh.write(struct.pack(_FORMAT, 0.0, 0))
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
