"""Spatial x data parallel training of 3D CNNs.

>>> grid = parallel.init(spatial=(2, 1, 1))        # from torchrun, mpirun, srun or python
>>> pmodel = parallel.parallelize(model, grid)      # the serial model's parallel form
>>> y = pmodel(parallel.scatter(x, grid))           # this rank's block in, its block out
>>> parallel.parallelize(model, grid, verify=True)  # also check against the serial model once
>>> parallel.whole(p, p.grad)                        # a sharded weight's gradient, as serial holds it

The package's folders are its layers, each importing only the ones below it (the module
map in docs/parallel.md): the grid; ``comm``; ``runtime`` and ``split``; ``layers``;
``model`` and ``data``; ``verify`` and ``kfac``; ``job``; ``plan``; this public API;
``infer``; ``train``.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence, Union

import torch
from torch import nn

from parallel import verify  # parallel.verify.verify(serial, pmodel, probe): the check against serial
from parallel.comm import all_reduce_sum, replicated_grad, spatial_sum
from parallel.grid import Grid
from parallel.layers.linear import whole
from parallel.model.parallel_module import ParallelModule
from parallel.model.parallelize import parallelize as _split_form
from parallel.partition import SplitError, block_bounds
from parallel.runtime.launch import destroy, init
from parallel.split.scatter import gather, scatter
from parallel.verify.check import verify as _against_serial

__all__ = [
    "Grid", "ParallelModule", "SplitError", "all_reduce_sum", "block_bounds", "destroy", "gather",
    "init", "parallelize", "replicated_grad", "scatter", "spatial_sum", "verify", "whole",
]

Probe = Union[None, bool, Sequence[int], torch.Tensor]
"""What ``parallelize(..., verify=...)`` accepts: off (None, False), True (a probe sized
from the network), a probe shape (N, C, D, H, W) or a global probe tensor."""


def parallelize(model: nn.Module, grid: Grid, *, verify: Probe = None, overlap_halo: Any = None,
                **options: Any) -> ParallelModule:
    """The hybrid-parallel form of ``model`` for ``grid`` (its layers converted in place):
    ``parallel.model.parallelize.parallelize``, whose options it takes, with two more.

    ``overlap_halo="auto"``: each split convolution overlaps its halo exchange where the
    planner's cost model says it pays (``parallel.plan.overlap_policy``: the calibration of
    ``scripts/benchmark.py calibrate``, else generic figures); True, False or a policy as
    there. ``verify`` (a probe: True for one sized from the network, a shape (N, C, D, H,
    W), or a global tensor) runs the serial model and the split model once on the probe and
    raises ``parallel.verify.VerificationError`` naming the first module whose output (or
    the first parameter whose gradient) differs.
    """
    if overlap_halo == "auto":
        from parallel.plan import overlap_policy  # loaded on use: the planner reads the calibration

        overlap_halo = overlap_policy()
    serial = copy.deepcopy(model) if verify is not None and verify is not False else None
    pmodel = _split_form(model, grid, overlap_halo=overlap_halo, **options)
    if serial is not None:
        _against_serial(serial, pmodel, None if verify is True else verify)  # type: ignore[arg-type]
    return pmodel
