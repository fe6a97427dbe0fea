"""``parallel.verify`` in a training job: the split model against its serial self, once,
before the first step.

``serial_copy`` keeps a copy of the serial network before ``parallelize`` converts it
(None when nothing is to be verified); ``run`` compares the two on a small probe
(``parallel.verify``), in float64 for a float32 network, and stops the job, on every rank
alike, with ``SplitMismatch`` (exit 2) naming the first module whose output differs and
the likely cause.

``parallel.verify=auto`` (the default) verifies when the grid splits samples in space and
the network runs code ``parallelize`` cannot see (``custom_forwards``: any module whose
``forward`` is not a ``torch.nn`` layer's) or is a ``model._target_`` network. The probe
is sized from the network (its downsampling times the split); a network that accepts only
its training volume (a ``Flatten`` + ``Linear`` head) is verified on one whole sample when
that is at most ``PROBE_LIMIT`` voxels, and skipped with a message otherwise.
``parallel.verify=true`` always verifies (on a whole sample if it must); ``false`` never.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from parallel.grid import Grid
from parallel.job.errors import InputError
from parallel.model.parallel_module import ParallelModule
from parallel.verify import VerificationError, custom_forwards, verify
from parallel.verify.probe import choose_probe

log = logging.getLogger("parallel.train")

PROBE_LIMIT = 64**3
"""Voxels of the largest whole sample ``auto`` verifies on (a serial forward and backward
of it on every rank), when the network accepts no smaller probe."""

OFF_HINT = ("parallel.verify=false trains it anyway, and then its numbers differ from the serial model's "
            "(docs/parallel.md, 'Models you bring')")


class SplitMismatch(InputError):
    """The split model's numbers differ from the serial model's on the probe."""


def mode(setting: Any) -> str:
    """``parallel.verify`` as ``auto``, ``true`` or ``false``."""
    return str(setting).lower()


def serial_copy(setting: Any, model: nn.Module, grid: Grid, user_model: bool) -> nn.Module | None:
    """A copy of the serial ``model`` to verify against, or None when the job does not
    verify (``setting``: ``parallel.verify``; ``user_model``: a ``model._target_`` network)."""
    how = mode(setting)
    if how == "false":
        return None
    if how == "auto":
        if grid.spatial_size == 1:
            return None  # nothing is split: the parallel model runs the serial layers
        custom = custom_forwards(model)
        if not custom and not user_model:
            log.debug("parallel.verify=auto: only torch.nn layers and containers, nothing to verify")
            return None
    return copy.deepcopy(model)


@contextlib.contextmanager
def _in_float64(serial: nn.Module, pmodel: ParallelModule) -> Iterator[None]:
    """Both models in float64 for the check, then back (float32 -> float64 -> float32 is exact).

    In float32 a weight's gradient is a sum over every voxel of the probe, and the two
    models add it up in different orders: where the terms cancel (an InstanceNorm on a
    bottleneck of a few voxels) the sums differ by more than any fixed float32 tolerance
    without a split error. In float64 they agree to ~1e-13 and a split error still shows.
    """
    dtypes = {p.dtype for p in pmodel.parameters() if p.is_floating_point()}
    if dtypes != {torch.float32}:  # bf16/fp16 weights or a mix: as they are (verify's own tolerance)
        yield
        return
    serial.double()
    pmodel.double()
    try:
        yield
    finally:
        pmodel.float()
        serial.float()
        if pmodel.sync is not None:  # its float64 buffers: the next forward allocates float32 ones
            pmodel.sync.drop_buffers()


def run(serial: nn.Module | None, pmodel: ParallelModule, setting: Any, seed: int, volume: Sequence[int],
        channels: int) -> dict[str, float] | None:
    """Verify ``pmodel`` against ``serial`` (from ``serial_copy``; None: nothing to do) on a
    probe of one sample of ``channels`` x ``volume`` at most, drawn from ``seed``.

    Collective over the grid. Raises ``SplitMismatch`` (exit 2) where they differ;
    returns the largest relative differences, or None when skipped.
    """
    if serial is None:
        return None
    how = mode(setting)
    probe, chosen = choose_probe(serial, pmodel.grid, channels, volume, None if how == "true" else PROBE_LIMIT)
    if probe is None:
        hint = "; parallel.verify=true verifies on a whole sample" if how != "true" else ""
        log.warning("parallel.verify=%s: skipped: %s%s", how, chosen, hint)
        return None
    t0 = time.perf_counter()
    try:
        with _in_float64(serial, pmodel):
            report = verify(serial, pmodel, probe, seed=seed)
    except VerificationError as err:
        failure = SplitMismatch(f"parallel.verify: {err} {OFF_HINT}.")
        # a split forward that raised may have raised on some ranks only: each says so itself
        failure.collective = not str(err).startswith("the split model failed")  # type: ignore[misc]
        raise failure from None
    except ValueError as err:  # the serial model rejected the probe on every rank alike
        log.warning("parallel.verify=%s: skipped: %s", how, err)
        return None
    log.info("parallel.verify: checked before the first step on probe %s (%s) in %.2f s", list(probe), chosen,
             time.perf_counter() - t0)
    return report
