"""The probe a split model is checked on: small where the network allows, whole where it must.

``probe_shape`` sizes one from the network's downsampling: per dim its total downsampling
factor times the split (at least 2), so its deepest level still has a voxel per block;
``choose_probe`` takes that where the network accepts it, else one whole sample (when
allowed), and says why. Both size the network by dry runs on the meta device
(``parallel.model.trace``: no memory, no work).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from torch import nn

from parallel.grid import Grid
from parallel.model.trace import hooked, meta_copy, meta_forward
from parallel.split.nested import tensors as _leaves


def _in_channels(model: nn.Module) -> int:
    for m in model.modules():
        if isinstance(getattr(m, "in_channels", None), int):
            return int(m.in_channels)  # type: ignore[arg-type]
    raise ValueError(f"cannot tell the input channels of {type(model).__name__}; pass a probe shape")


def _downsampling(model: nn.Module, channels: int, reach: int | Sequence[int]) -> list[int]:
    """Per dim, how much the network shrinks its input (a dry run on the meta device, on a
    volume of ``reach`` voxels per dim, or of the shape ``reach``)."""
    dims = [int(reach)] * 3 if isinstance(reach, int) else [int(r) for r in reach]
    smallest = list(dims)

    def seen(_name: str, _m: nn.Module, _inputs: Any, out: Any) -> None:
        for t in _leaves(out):
            if t.dim() == 5 and any(s > 1 for s in t.shape[2:]):
                for a in range(3):
                    smallest[a] = min(smallest[a], max(1, int(t.shape[a + 2])))

    try:
        dry = meta_copy(model)
        with hooked(dry, seen):
            meta_forward(dry, (channels, *dims))  # in the weights' dtype: fp64 models too
    except Exception as err:  # noqa: BLE001 - any failure means: ask the user for the probe
        raise ValueError(f"could not size a probe for {type(model).__name__} from a dry run on a "
                         f"{'x'.join(map(str, dims))} volume ({type(err).__name__}: {err}); pass a probe shape "
                         "(N, C, D, H, W) that the network accepts") from err
    return [2 ** math.ceil(math.log2(n / s)) for n, s in zip(dims, smallest)]


def probe_shape(model: nn.Module, grid: Grid, channels: int | None = None,
                reach: int | Sequence[int] = 256) -> tuple[int, ...]:
    """A small probe the network accepts: per dim, its total downsampling factor times
    the split (at least 2), so its deepest level still has a voxel per block; one row per
    data group. The factor comes from a dry run on the meta device (no memory, no work)
    on a ``reach``-voxel cube, or on the volume ``reach`` (D, H, W) that the network was
    built for."""
    channels = _in_channels(model) if channels is None else channels
    factors = _downsampling(model, channels, reach)
    return (grid.data_size, channels, *(max(f * max(2, s), 4) for f, s in zip(factors, grid.spatial)))


def _accepts(model: nn.Module, shape: Sequence[int]) -> bool:
    """Whether the network runs on one sample of ``shape`` (a dry run on the meta device, in
    the weights' dtype: a float32 probe of a float64 model, train.precision=fp64, fails on its type)."""
    try:
        meta_forward(meta_copy(model), tuple(shape[1:]))
    except Exception:  # noqa: BLE001 - any failure: not this probe
        return False
    return True


def choose_probe(serial: nn.Module, grid: Grid, channels: int, volume: Sequence[int],
                 whole_limit: int | None = None) -> tuple[tuple[int, ...] | None, str]:
    """(the probe shape, how it was chosen) or (None, why there is none).

    Sized from the network's downsampling (``probe_shape``, dry runs on the meta device);
    else one whole sample of ``volume`` per data group, when it has at most
    ``whole_limit`` voxels (None: any).
    """
    whole = (grid.data_size, channels, *(int(v) for v in volume))
    whole_allowed = whole_limit is None or math.prod(whole[2:]) <= whole_limit
    try:
        small: tuple[int, ...] | None = probe_shape(serial, grid, channels, reach=tuple(volume))
    except ValueError:
        small = None
    smaller = small is not None and math.prod(small[2:]) < math.prod(whole[2:])
    if smaller and _accepts(serial, small):  # type: ignore[arg-type]
        return small, "sized from the network"
    if whole_allowed and _accepts(serial, whole):
        why = "the network accepts no smaller probe" if smaller else \
            "the network's downsampling times the split needs the whole volume"
        return whole, f"one whole sample per data group: {why}"
    if whole_allowed:
        return None, (f"the network runs on no probe, not even one whole sample {list(whole[1:])} (a dry run on "
                      f"the meta device failed)")
    return None, (f"the network accepts no probe smaller than its training volume {list(volume)}, and a serial "
                  f"forward and backward of a whole sample on every rank is more than allowed (over "
                  f"{whole_limit} voxels)")
