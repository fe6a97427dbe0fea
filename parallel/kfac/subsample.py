"""Cheaper factor updates: subsampled positions, intervals from measured staleness, and
Gram products in lower precision.

**Subsampled positions** (``KFACConfig.position_stride``, after KFC's spatially subsampled
patches, Grosse & Martens 2016). A convolution's A is the mean of ``a a^T`` over every
output position; with stride ``s`` it is the mean over the output positions whose *global*
coordinates are all multiples of ``s`` (about ``1/s^3`` of them). Output position ``o``
reads the input window starting at ``o * stride``, so those patches are the patches of a
convolution with stride ``s * stride`` over the window cropped by ``f * stride`` at its
start, ``f = (-origin) mod s`` the first sampled position of the block: the existing patch
Gram (and its sketch) runs unchanged on a view. Under a spatial split each rank's block
starts at its global output ``origin``, so every rank picks exactly the global positions
the serial run picks, and the all-reduced sums and counts are the serial ones: the split
still equals serial. A is a mean (divided by the pooled count of sampled patches), so no
rescaling is needed. G (channel Grams over output positions) and a transposed
convolution's factors (over input positions, a few percent of the work at the
quickstarts' sizes) take every position.

**Intervals from staleness** (``KFACConfig.stale_tol``). After every factor update the
relative change of the running factors, ``max over layers and sides of
|F_t - F_prev|_F / |F_t|_F``, is measured (on the all-reduced factors, identical on every
rank, so every rank takes the same decision). Below ``stale_tol`` the interval between
factor updates moves one step up a ladder of multiples of ``factor_interval`` that divide
``inverse_interval`` (so every eigendecomposition still sees freshly updated factors),
above ``2 stale_tol`` one step down; ``max_factor_interval`` caps it. ``stale_tol=0`` (the
default) measures and reports the change but never moves the interval.

**Gram products in lower precision** (``KFACConfig.gram_dtype``): the patches of the A
Gram products are copied out in bfloat16 or float16 and multiplied in that precision,
each slab's product added into the factor's own precision (float32 or float64), so the
running sums, the all-reduce and the averages keep theirs. ``gram_error`` measures what
that costs a factor.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Sequence

import torch

from parallel import comm
from parallel.kfac.factors import packed_size
from parallel.layers.conv.layer import conv_pads
from parallel.partition import block_bounds

log = logging.getLogger("parallel.kfac")

# Changes kept for the summary (a longer run keeps its first ones; the report's statistics cover those).
HISTORY = 4096


# -- subsampled positions -----------------------------------------------------------------
def output_origin(module: Any, dims: Sequence[int]) -> tuple[int, int, int]:
    """The global output coordinates of this rank's first output position of the spatial
    convolution ``module`` whose global input is ``dims`` (D, H, W): its output block's start
    (``SpatialConv3d`` splits the output canonically, ``block_bounds``)."""
    origin = []
    for axis in range(3):
        left, right = conv_pads(module, axis)
        k, s, d = module.kernel_size[axis], module.stride[axis], module.dilation[axis]
        m = (int(dims[axis]) + left + right - d * (k - 1) - 1) // s + 1
        origin.append(block_bounds(m, module.grid.spatial[axis])[module.grid.coords[axis]][0])
    return origin[0], origin[1], origin[2]


def sampled_window(padded: torch.Tensor, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int],
                   origin: Sequence[int], every: int) -> tuple[torch.Tensor, tuple[int, int, int]] | None:
    """The view of the padded window ``padded`` whose patches at stride ``every * stride``
    are the patches of the output positions with global coordinates ``origin + j`` that are
    multiples of ``every`` in each dim, and that stride; None if the block has none."""
    crop = []
    for axis in range(3):
        span = dilation[axis] * (kernel[axis] - 1) + 1
        local = (padded.shape[2 + axis] - span) // stride[axis] + 1  # output positions of the block
        first = (-int(origin[axis])) % every
        if first >= local:
            return None
        crop.append(first * stride[axis])
    view = padded[:, :, crop[0]:, crop[1]:, crop[2]:]
    return view, (stride[0] * every, stride[1] * every, stride[2] * every)


def sampled_positions(out_dims: Sequence[int], every: int) -> int:
    """How many of an output volume's positions (per sample) a stride of ``every`` samples."""
    return math.prod(-(-int(n) // every) for n in out_dims)


# -- intervals from staleness --------------------------------------------------------------
def ladder(factor_interval: int, inverse_interval: int, cap: int) -> list[int]:
    """The intervals a factor update may take: multiples of ``factor_interval`` that divide
    ``inverse_interval``, at most ``cap`` (0: no cap), ascending."""
    top = inverse_interval if cap <= 0 else min(cap, inverse_interval)
    rungs = [k for k in range(factor_interval, top + 1, factor_interval) if inverse_interval % k == 0]
    return rungs or [factor_interval]


def own_spans(layers: Sequence[Any], grid: Any) -> tuple[dict[str, tuple[int, int]], Any]:
    """Per layer whose hierarchical A is held on its ranks (``Layer.own``), where its packed A
    keeps this rank's own diagonal blocks (after the sketch; the bias' block, which every rank
    holds, excluded), and the group those spans are summed over (the spatial group; None when
    no layer has one)."""
    spans = {}
    for layer in layers:
        if layer.own is not None:
            start = layer.dim_a * (layer.omega.shape[1] + 1)
            leaves = layer.leaves[:len(layer.leaves) - layer.own.shared]
            spans[layer.key] = (start, start + sum(packed_size(len(b)) for b in leaves))
    return spans, (grid.spatial_group if spans else None)


def relative_change(old: dict[str, tuple[torch.Tensor, torch.Tensor]],
                    new: dict[str, tuple[torch.Tensor, torch.Tensor]],
                    own: Mapping[str, tuple[int, int]] | None = None, group: Any = None) -> float | None:
    """``max over layers and sides of |new - old|_F / |new|_F`` (layers in both; None if none).

    ``own``: per layer, the span of its packed A that holds this rank's own diagonal blocks
    (a hierarchical A held on its ranks: ``parallel.kfac.local``); the squares of those spans
    are summed over ``group`` (the spatial group; a collective), the rest of the factor being
    the same on every rank, so every rank measures the serial run's change and decides alike."""
    sums: list[list[torch.Tensor]] = []  # per factor: [|new - old|^2, |new|^2] of its shared part
    owned: list[torch.Tensor] = []  # per factor: the same of its own span (A of an ``own`` layer), else 0
    for key, pair in new.items():
        before = old.get(key)
        if before is None:
            continue
        for side, (f, g) in enumerate(zip(pair, before)):
            d = (f - g).reshape(-1).double()
            f = f.reshape(-1).double()
            lo, hi = (own or {}).get(key, (0, 0)) if side == 0 else (0, 0)
            mine = torch.stack([d[lo:hi].square().sum(), f[lo:hi].square().sum()])
            sums.append([d.square().sum() - mine[0], f.square().sum() - mine[1]])
            owned.append(mine)
    if not sums:
        return None
    totals = torch.stack([torch.stack(t) for t in sums])
    if own:
        totals = totals + comm.all_reduce_(torch.stack(owned), group, caller="kfac: the factors' change")
    worst = 0.0
    for d2, f2 in totals.tolist():
        worst = max(worst, (d2 / f2) ** 0.5 if f2 > 0 else 0.0)
    return worst


class Staleness:
    """The measured change of the factors between updates and the interval it chooses."""

    def __init__(self, factor_interval: int, inverse_interval: int, tol: float, cap: int) -> None:
        self.rungs = ladder(factor_interval, inverse_interval, cap)
        self.tol, self.inverse = tol, inverse_interval
        self.base = self.interval = factor_interval
        self.history: list[tuple[int, float, int]] = []  # (step, change, interval chosen after it)
        self.updates = 0

    @classmethod
    def of(cls, cfg: Any) -> "Staleness":
        """The schedule of a ``KFACConfig``: the measured change of its factors decides when
        ``stale_tol > 0``; the all-reduced factors are the same on every rank, so is the change
        and the interval it picks."""
        return cls(cfg.factor_interval, cfg.inverse_interval, cfg.stale_tol, cfg.max_factor_interval)

    def observe(self, step: int, change: float | None) -> None:
        """Record the change measured at the factor update of step ``step``; move the interval."""
        self.updates += 1
        if change is None:
            return
        before = self.interval
        if self.tol > 0:
            i = self.rungs.index(self.interval) if self.interval in self.rungs else 0
            if change < self.tol and i + 1 < len(self.rungs):
                self.interval = self.rungs[i + 1]
            elif change > 2 * self.tol and i > 0:
                self.interval = self.rungs[i - 1]
        if len(self.history) < HISTORY:
            self.history.append((step, change, self.interval))
        if self.interval != before:
            log.info("kfac: step %d: the factors changed by %.3g (kfac.stale_tol %g): factor updates every %d steps "
                     "(were %d)", step, change, self.tol, self.interval, before)
        else:  # at INFO with each inverse update, else at DEBUG
            log.log(logging.INFO if step % self.inverse == 0 else logging.DEBUG,
                    "kfac: step %d: the factors changed by %.3g since the last update (factor updates every %d "
                    "steps)", step, change, self.interval)

    def captures(self, step: int) -> bool:
        return step % self.interval == 0

    def report(self) -> dict[str, Any]:
        changes = [c for _, c, _ in self.history]
        return {"tol": self.tol, "interval": self.interval, "updates": self.updates,
                "change_last": changes[-1] if changes else None,
                "change_median": sorted(changes)[len(changes) // 2] if changes else None,
                "change_max": max(changes) if changes else None,
                "history": [[s, c, i] for s, c, i in self.history]}

    def state(self) -> dict[str, Any]:
        return {"interval": self.interval, "updates": self.updates}

    def load(self, state: dict[str, Any] | None) -> None:
        """Take a saved state (None: the interval starts at ``factor_interval``); the history
        reported starts afresh (the count of updates goes on)."""
        self.history = []
        if state is None:
            self.interval, self.updates = self.base, 0
            return
        interval = int(state["interval"])
        self.interval = interval if interval in self.rungs else self.base
        if interval not in self.rungs:
            log.warning("kfac: the saved factor interval %d is not one of %s (kfac.factor_interval, "
                        "inverse_interval and max_factor_interval as set now): back to %d", interval, self.rungs,
                        self.base)
        self.updates = int(state.get("updates", 0))


# -- lower precision ------------------------------------------------------------------------
def gram_error(exact: torch.Tensor, low: torch.Tensor) -> float:
    """``|low - exact|_F / |exact|_F`` of a factor taken in lower precision."""
    return float(torch.linalg.vector_norm(low.double() - exact.double()) / torch.linalg.vector_norm(exact.double()))
