"""A program that uses only the public API and must always exit 0.

``parallel.init``, ``parallelize``, ``scatter``, a forward and backward, ``gather``,
``parallel.destroy()``: nothing else. Rank 0 prints one JSON line with what the grid
knows about the job (its placement, gathered at start-up) and whether the gathered output
equals the serial model's::

    torchrun --nproc-per-node 4 tests/support/public_api_program.py        # spatial split of 4
    mpirun -n 4 python tests/support/public_api_program.py
"""

import copy
import json

import torch
from torch import nn

import parallel


def main() -> None:
    torch.set_num_threads(1)
    grid = parallel.init(spatial=(4, 1, 1), timeout_s=120)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU(), nn.MaxPool3d(2),
                          nn.ConvTranspose3d(4, 2, 2, stride=2))
    serial = copy.deepcopy(model)
    pmodel = parallel.parallelize(model, grid)
    x = torch.randn(2 * grid.data_size, 2, 8, 6, 6, generator=torch.Generator().manual_seed(1))
    y = pmodel(parallel.scatter(x, grid))
    y.square().sum().backward()
    full = parallel.gather(y.detach(), grid)
    ok = bool(torch.allclose(full, serial(x), rtol=1e-5, atol=1e-6))
    if grid.rank == 0:
        print(json.dumps({"ok": ok, "world_size": grid.world_size, "launcher": grid.launcher,
                          "local_rank": grid.local_rank, "local_size": grid.local_size,
                          "node_count": grid.node_count, "ranks_per_node": grid.ranks_per_node,
                          "store_address": grid.store_address, "device": str(grid.device)}), flush=True)
    parallel.destroy()


if __name__ == "__main__":
    main()
