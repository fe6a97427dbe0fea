"""The geometry of the MLPerf sliding-window evaluation: which part of a case is kept,
how it is padded, where the windows go, and the Gaussian importance of a window's voxels.

Reproduces ``sliding_window_inference`` of the MLPerf U-Net reference (mlcommons/training,
image_segmentation/pytorch, ``runtime/inference.py``), per dim of a case of ``n`` voxels,
window ``w`` and ``stride = int(w * (1 - overlap))`` (64 for 128 and 0.5):

1. Keep: ``r = n % stride``; if ``r < stride // 2`` the case loses ``r`` voxels, ``r // 2``
   at the start and the rest at the end (the label likewise: those voxels are not scored);
   otherwise it keeps all ``n``.
2. Pad the kept ``m`` voxels with -2.2 up to a multiple of the stride,
   ``(stride - m % stride) % stride`` voxels, plus one more stride when that is still
   shorter than the window; half (rounded down) before, the rest after.
3. Windows start at ``0, stride, 2 stride, ...`` while they fit in the padded length.
4. The importance map is the cube root of the outer product of three 1-D Gaussian windows
   (``scipy.signal.gaussian(w, 0.125 w)``: centre ``(w - 1) / 2``, sigma ``0.125 w``),
   scaled to a maximum of 1. The cube root makes it the product of 1-D Gaussians of sigma
   ``0.125 w sqrt(3)``, which ``importance_factors`` returns (each scaled to max 1).
5. Logits of every window times the map are summed, divided by the summed map, cut back
   to the kept part (step 2 undone), and the argmax is the prediction.

The reference uses ``w = roi_shape[0]`` for every dim (cubic windows); here each dim uses
its own window size, which is the same for cubes. Its cut-back slices with the case's
original size, which for a case of 65..95 voxels along a dim (kept 64, padded to 128)
returns more voxels than the cropped label has and fails; here the cut-back is to the
kept size. Windows that leave part of the padded case uncovered (possible in the
reference for overlaps other than 0.5) are refused here instead of dividing by zero.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch

from parallel.data.crops import Region

PAD_VALUE = -2.2
"""The reference's padding value (the normalised intensity of air, about -79 HU clipped)."""


@dataclass(frozen=True)
class WindowPlan:
    """Where the windows go over the kept part of one case (all in voxels, per dim).

    ``kept``: size of the kept part; ``pad``: (before, after) padding of it; ``starts``:
    window origins in the padded frame; ``window`` and ``stride`` as given.
    """

    kept: tuple[int, int, int]
    window: tuple[int, int, int]
    stride: tuple[int, int, int]
    pad: tuple[tuple[int, int], ...]
    starts: tuple[tuple[int, ...], ...]

    @property
    def padded(self) -> tuple[int, int, int]:
        return tuple(m + a + b for m, (a, b) in zip(self.kept, self.pad))  # type: ignore[return-value]

    @property
    def n_windows(self) -> int:
        return math.prod(len(s) for s in self.starts)

    def origins(self) -> Iterator[tuple[int, int, int]]:
        """Window origins in the padded frame, in the reference's loop order (D outermost)."""
        return itertools.product(*self.starts)  # type: ignore[return-value]


def strides(window: Sequence[int], overlap: float) -> tuple[int, int, int]:
    """``int(w * (1 - overlap))`` per dim, as the reference computes them."""
    out = tuple(int(w * (1 - overlap)) for w in window)
    if min(out) < 1:
        raise ValueError(f"overlap {overlap} leaves no stride for window {list(window)}")
    return out  # type: ignore[return-value]


def kept_range(shape: Sequence[int], window: Sequence[int], overlap: float = 0.5) -> tuple[tuple[int, int], ...]:
    """``[start, stop)`` per dim of the part of a case the reference evaluates (step 1)."""
    out = []
    for axis, (n, s) in enumerate(zip(shape, strides(window, overlap))):
        r = int(n) % s
        r = r if r < s // 2 else 0
        if r >= int(n):
            raise ValueError(f"a case of {n} voxels along dim {'DHW'[axis]} is shorter than half a stride ({s} // 2): "
                             "the reference's evaluation would keep none of it")
        out.append((r // 2, int(n) - (r - r // 2)))
    return tuple(out)


def plan_windows(kept: Sequence[int], window: Sequence[int], overlap: float = 0.5) -> WindowPlan:
    """Padding and window origins for the kept part of a case (steps 2 and 3)."""
    kept = tuple(int(m) for m in kept)
    window = tuple(int(w) for w in window)
    if len(kept) != 3 or len(window) != 3:
        raise ValueError(f"want three dims, got kept {list(kept)} and window {list(window)}")
    step = strides(window, overlap)
    pad, starts = [], []
    for axis, (m, w, s) in enumerate(zip(kept, window, step)):
        extra = (s - m % s) % s
        if m + extra < w:
            extra += s
        padded = m + extra
        count = (padded - w) // s + 1
        if count < 1 or (count - 1) * s + w != padded:
            raise ValueError(
                f"windows of {w} with stride {s} (overlap {overlap}) do not tile the {padded} padded voxels of "
                f"a kept size of {m} along dim {'DHW'[axis]}: some voxels would get no window")
        pad.append((extra // 2, extra - extra // 2))
        starts.append(tuple(range(0, count * s, s)))
    return WindowPlan(kept, window, step, tuple(pad), tuple(starts))  # type: ignore[arg-type]


def gaussian_1d(n: int, sigma: float) -> np.ndarray:
    """``scipy.signal.gaussian(n, sigma)``: exp(-(k - (n - 1) / 2)^2 / (2 sigma^2)), float64."""
    k = np.arange(n, dtype=np.float64) - (n - 1) / 2.0
    return np.exp(-0.5 * (k / sigma) ** 2)


def importance_factors(window: Sequence[int], sigma_scale: float = 0.125) -> list[torch.Tensor]:
    """The importance map as three 1-D float64 factors (each max 1) whose outer product is
    the reference's ``cbrt(g (x) g (x) g) / max`` (step 4)."""
    out = []
    for w in window:
        f = np.cbrt(gaussian_1d(int(w), sigma_scale * int(w)))
        out.append(torch.from_numpy(f / f.max()))
    return out


def importance_map(window: Sequence[int], sigma_scale: float = 0.125) -> torch.Tensor:
    """The whole (wd, wh, ww) float64 importance map."""
    a, b, c = importance_factors(window, sigma_scale)
    return a[:, None, None] * b[None, :, None] * c[None, None, :]


def coverage_1d(plan: WindowPlan, axis: int, factor: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Summed importance along one dim over kept voxels ``[lo, hi)``: the 1-D factor of the
    normalisation map (the 3-D map is separable, and so is its sum over the window grid)."""
    out = torch.zeros(hi - lo, dtype=torch.float64)
    before, w = plan.pad[axis][0], plan.window[axis]
    for s in plan.starts[axis]:
        a, b = max(lo, s - before), min(hi, s - before + w)  # the window in kept coordinates
        if a < b:
            out[a - lo:b - lo] += factor[a + before - s:b + before - s]
    return out


class WindowCrop:
    """The region policy of sliding-window evaluation: each case's kept part (step 1), so
    that every rank reads its block of exactly what is scored (``BlockDataset(regions=)``).

    ``drop_remainder=False`` keeps the whole case (prediction labels every voxel; the
    windows then cover the whole case, padded as in step 2)."""

    fields: tuple[str, ...] = ()

    def __init__(self, window: Sequence[int], overlap: float = 0.5, drop_remainder: bool = True) -> None:
        self.window = tuple(int(w) for w in window)
        self.overlap = float(overlap)
        self.drop_remainder = drop_remainder
        strides(self.window, self.overlap)

    def region(self, index: int, epoch: int, shape: Sequence[int],
               scalars: Mapping[str, np.ndarray]) -> Region:
        if not self.drop_remainder:
            return CaseRegion().region(index, epoch, shape, scalars)
        ranges = kept_range(shape, self.window, self.overlap)
        return Region(tuple(a for a, _ in ranges), tuple(b - a for a, b in ranges))  # type: ignore[arg-type]


class CaseRegion:
    """The whole case as a region: samples then carry their case's shape (``REGION_KEY``)."""

    fields: tuple[str, ...] = ()

    def region(self, index: int, epoch: int, shape: Sequence[int],
               scalars: Mapping[str, np.ndarray]) -> Region:
        return Region((0, 0, 0), tuple(int(n) for n in shape))  # type: ignore[arg-type]
