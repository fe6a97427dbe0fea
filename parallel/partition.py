"""How a global dim is cut into blocks, and which ranks own which indices.

Pure integer logic, no processes: the grid, the halo exchange and the slab reader all
ask these functions, so they agree on every block boundary.

A global dim of size ``n`` split ``parts`` ways gives blocks of ``n // parts`` or
``n // parts + 1`` indices, the lower positions taking the larger blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DIM_NAMES = ("D", "H", "W")


class SplitError(ValueError):
    """A volume (or a layer's output) cannot be cut the way the grid asks."""


def block_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` of each of ``parts`` blocks of a dim of size ``n``."""
    if parts < 1:
        raise SplitError(f"cannot split a dim into {parts} parts")
    if n < parts:
        raise SplitError(f"a dim of size {n} cannot be split {parts} ways (fewer voxels than blocks)")
    base, extra = divmod(n, parts)
    bounds = []
    start = 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def owner_of(index: int, n: int, parts: int) -> int:
    """The block position that holds global ``index`` (0 <= index < n)."""
    base, extra = divmod(n, parts)
    big = extra * (base + 1)
    if index < big:
        return index // (base + 1)
    return extra + (index - big) // base


@dataclass(frozen=True)
class Segment:
    """A run of a window that one block supplies.

    ``owner`` is the block position (None for fill: out of the volume under constant
    padding), ``src`` the start inside the owner's block, ``dst`` the start inside the
    window, ``length`` the number of indices.
    """

    owner: int | None
    src: int
    dst: int
    length: int


def window_segments(
    lo: int, hi: int, n: int, parts: int, mode: Literal["constant", "circular"]
) -> list[Segment]:
    """Cut the global window ``[lo, hi)`` into runs, each from one block or fill.

    Indices outside ``[0, n)`` are fill under ``constant`` padding and wrap around under
    ``circular`` padding (periodic boxes).
    """
    bounds = block_bounds(n, parts)
    segments: list[Segment] = []
    pos = lo
    while pos < hi:
        if mode == "constant" and (pos < 0 or pos >= n):
            stop = min(hi, 0) if pos < 0 else hi
            segments.append(Segment(None, 0, pos - lo, stop - pos))
            pos = stop
            continue
        g = pos % n if mode == "circular" else pos
        owner = owner_of(g, n, parts)
        start, stop = bounds[owner]
        length = min(hi - pos, stop - g)
        segments.append(Segment(owner, g - start, pos - lo, length))
        pos += length
    return segments
