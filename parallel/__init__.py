"""Spatial x data parallel training of 3D CNNs.

>>> grid = parallel.init(spatial=(2, 1, 1))        # from torchrun, mpirun, srun or python
>>> pmodel = parallel.parallelize(model, grid)      # the serial model's parallel form
>>> y = pmodel(parallel.scatter(x, grid))           # this rank's block in, its block out
>>> parallel.parallelize(model, grid, verify=True)  # also check against the serial model once
"""

from parallel.comm import all_reduce_sum, replicated_grad, spatial_sum
from parallel.grid import Grid
from parallel.runtime.launch import destroy, init
from parallel.model.parallel_module import ParallelModule
from parallel.model.parallelize import parallelize
from parallel.partition import SplitError, block_bounds
from parallel.split.scatter import gather, scatter
from parallel import verify  # parallel.verify.verify(serial, pmodel, probe): the check against serial

__all__ = [
    "Grid", "ParallelModule", "SplitError", "all_reduce_sum", "block_bounds", "destroy", "gather",
    "init", "parallelize", "replicated_grad", "scatter", "spatial_sum", "verify",
]
