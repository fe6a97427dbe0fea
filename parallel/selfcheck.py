"""Check that a spatially split model equals its serial twin, under any launcher.

Builds a small serial model with every layer type ``parallelize`` converts, runs one
forward and backward on a seeded global batch split over the grid, and compares the
gathered outputs, input gradient and parameter gradients with the serial model run on
every rank. Data groups each take the mean loss over their rows (as under DDP) and
BatchNorm spans the global batch, so any grid reproduces the serial numbers. Prints one JSON line (rank 0) with checksums and the largest relative
differences; exits 1 if any exceeds the tolerance. The checksums are those of the
serial maths, so the same command prints the same numbers under every launcher::

    python -m parallel.selfcheck                                   # one process
    torchrun --nproc-per-node 4 -m parallel.selfcheck --spatial 2 1 1   # data 2 x spatial 2
    mpirun -n 4 python -m parallel.selfcheck --spatial 1 2 2
    srun -n 4 python -m parallel.selfcheck --spatial 1 2 2
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch
from torch import nn

import parallel


class EveryLayer(nn.Module):
    """A two-headed 3D CNN using every layer type that has a spatial twin.

    Returns a voxel-wise map (distributed over the spatial group) and a per-sample
    vector after Flatten+Linear (replicated), so both gradient paths are exercised.
    """

    def __init__(self, channels: int = 2, size: int = 12) -> None:
        super().__init__()
        self.encode = nn.Sequential(
            nn.Conv3d(channels, 4, 3, padding=1, bias=False), nn.BatchNorm3d(4), nn.ReLU(),
            nn.Conv3d(4, 4, 3, padding=1, padding_mode="circular", bias=False), nn.InstanceNorm3d(4, affine=True),
            nn.LeakyReLU(0.3), nn.MaxPool3d(2),
            nn.Conv3d(4, 8, 3, stride=2, padding=1, bias=False), nn.GroupNorm(2, 8), nn.Tanh(),
            nn.AvgPool3d(3, stride=1, padding=1),
        )
        self.decode = nn.Sequential(nn.ConvTranspose3d(8, 4, 2, stride=2), nn.ELU(), nn.Conv3d(4, 3, 1))
        feats = 8 * (size // 4) ** 3
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(feats, 16), nn.ReLU(), nn.Dropout(0.0), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.encode(x)
        return self.decode(z), self.head(z)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def run(grid: parallel.Grid, batch: int = 4, size: int = 12, seed: int = 0) -> dict:
    """Compare the parallel model with the serial one on this grid; returns the report.

    The serial loss is a mean over the global batch; each data group's loss is the mean
    over its own rows (as under DDP), and BatchNorm statistics span the global batch
    (``sync_batchnorm``), so outputs and parameter gradients equal the serial ones for any
    grid whose data size divides the batch.
    """
    if batch % grid.data_size:
        raise ValueError(f"--batch {batch} must be a multiple of the data size {grid.data_size}")
    torch.manual_seed(seed)
    serial = EveryLayer(size=size).to(grid.device)
    model = copy.deepcopy(serial)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, 2, size, size, size, generator=gen).to(grid.device)
    seg_target = torch.randn(batch, 3, size // 2, size // 2, size // 2, generator=gen).to(grid.device)
    vec_target = torch.randn(batch, 4, generator=gen).to(grid.device)

    xs = x.clone().requires_grad_(True)
    seg_ref, vec_ref = serial(xs)
    (((seg_ref * seg_target).sum() + (vec_ref * vec_target).sum()) / batch).backward()

    pmodel = parallel.parallelize(model, grid, sync_batchnorm=True)
    xl = parallel.scatter(x, grid).requires_grad_(True)
    seg, vec = pmodel(xl)
    r0, r1 = grid.batch_range(batch)
    rows = r1 - r0
    (((seg * parallel.scatter(seg_target, grid)).sum() + (vec * vec_target[r0:r1]).sum()) / rows).backward()

    seg_all, vec_all = parallel.gather(seg.detach(), grid), parallel.gather(vec.detach(), grid)
    grad_x = parallel.gather(xl.grad, grid) * (rows / batch)  # each group's loss is a mean over its rows
    diffs = {"segmentation": _rel(seg_all, seg_ref.detach()), "vector": _rel(vec_all, vec_ref.detach()),
             "input grad": _rel(grad_x, xs.grad)}
    serial_grads = dict(serial.named_parameters())
    diffs.update({f"grad {n}": _rel(p.grad, serial_grads[n].grad) for n, p in pmodel.module.named_parameters()})
    return {
        "world_size": grid.world_size, "data": grid.data_size, "spatial": list(grid.spatial),
        "launcher": grid.launcher,
        "checksums": {
            "segmentation": float(seg_all.double().sum()), "vector": float(vec_all.double().sum()),
            "input grad": float(grad_x.double().abs().sum()),
            "param grads": float(sum(p.grad.double().abs().sum() for p in pmodel.module.parameters())),
        },
        "max_rel_diff": max(diffs.values()),
        "worst": max(diffs, key=diffs.get),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spatial", type=int, nargs=3, default=[1, 1, 1], metavar=("SD", "SH", "SW"),
                    help="blocks along D, H, W (default 1 1 1); the data axis takes the rest")
    ap.add_argument("--batch", type=int, default=4, help="global batch (default 4)")
    ap.add_argument("--size", type=int, default=12, help="volume edge, a multiple of 4 (default 12)")
    ap.add_argument("--tolerance", type=float, default=1e-5, help="max relative difference (default 1e-5)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    grid = parallel.init(spatial=args.spatial, timeout_s=120)
    try:
        report = run(grid, batch=args.batch, size=args.size)
    finally:
        parallel.destroy()
    report["ok"] = report["max_rel_diff"] <= args.tolerance
    if grid.rank == 0:
        print(json.dumps(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
