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
    torchrun --nproc-per-node 8 -m parallel.selfcheck --spatial 2 2 2 --precision bf16   # GPUs, NCCL

``--precision`` picks the arithmetic and with it the tolerance (``TOLERANCE``): the
split sums the same products in another order, so the two differ by the rounding of
the arithmetic, never by more.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
from typing import Iterator

import torch
from torch import nn

from parallel.grid import Grid
from parallel.layers.linear import whole
from parallel.model.parallelize import parallelize
from parallel.runtime.launch import destroy, init
from parallel.split.scatter import gather, scatter


class EveryLayer(nn.Module):
    """A two-headed 3D CNN using every layer type that has a spatial twin.

    Returns a voxel-wise map (distributed over the spatial group) and a per-sample
    vector after Flatten+Linear (replicated), so both gradient paths are exercised; a
    squeeze-and-excitation gate multiplies a global pool's replicated output into the
    split volume.
    """

    def __init__(self, channels: int = 2, size: int = 12) -> None:
        super().__init__()
        self.encode = nn.Sequential(
            nn.Conv3d(channels, 4, 3, padding=1, bias=False), nn.BatchNorm3d(4), nn.ReLU(),
            nn.Conv3d(4, 4, 3, padding=1, padding_mode="circular", bias=False), nn.InstanceNorm3d(4, affine=True),
            nn.LeakyReLU(0.3), nn.MaxPool3d(2),
            nn.ConstantPad3d(1, 0.5), nn.Conv3d(4, 8, 3, stride=2, bias=False), nn.GroupNorm(2, 8), nn.Tanh(),
            nn.AvgPool3d(3, stride=1, padding=1),
        )
        self.gate = nn.Sequential(nn.AdaptiveAvgPool3d(1), nn.Conv3d(8, 8, 1), nn.Sigmoid())
        # nearest upsampling (an exact gather): a trilinear one's float32 rounding, split or not,
        # tips later bf16 casts and triples the bf16 difference (tests/ranks/test_layers_resample.py covers it)
        self.decode = nn.Sequential(nn.ConvTranspose3d(8, 4, 2, stride=2), nn.ELU(),
                                    nn.Upsample(scale_factor=2, mode="nearest"), nn.AdaptiveAvgPool3d(size // 2),
                                    nn.Conv3d(4, 3, 1))
        feats = 8 * (size // 4) ** 3
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(feats, 16), nn.ReLU(), nn.Dropout(0.0), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.encode(x)
        z = z * self.gate(z)
        return self.decode(z), self.head(z)


# The largest difference, relative to the largest value, that the split may show against
# serial in each arithmetic, for this model (a few layers deep, forward and backward):
TOLERANCE = {
    "fp64": 1e-10,  # double rounding (~1e-16 per operation), summed in another order
    "fp32": 1e-5,   # float32 (~6e-8 per operation); measured ~1e-6 on CPUs
    "tf32": 1e-2,   # TF32 products on GPUs (10-bit mantissa, ~5e-4 each); estimated, not yet measured
    "bf16": 5e-2,   # autocast to bfloat16 (8-bit mantissa, ~4e-3 per rounding)
    "fp16": 1e-2,   # autocast to float16 (11-bit mantissa, ~5e-4 per rounding)
}
PRECISIONS = tuple(TOLERANCE)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@contextlib.contextmanager
def _arithmetic(precision: str, device: torch.device) -> Iterator[None]:
    """Autocast for bf16/fp16; nothing otherwise (fp64 is the tensors' dtype, tf32 a flag
    set by ``init``)."""
    if precision in ("bf16", "fp16"):
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        with torch.autocast(device.type, dtype=dtype):
            yield
    else:
        yield


def run(grid: Grid, batch: int = 4, size: int = 12, seed: int = 0, precision: str = "fp32") -> dict:
    """Compare the parallel model with the serial one on this grid; returns the report.

    The serial loss is a mean over the global batch; each data group's loss is the mean
    over its own rows (as under DDP), and BatchNorm statistics span the global batch
    (``sync_batchnorm``), so outputs and parameter gradients equal the serial ones for any
    grid whose data size divides the batch. ``precision`` is one of ``PRECISIONS``.
    """
    if batch % grid.data_size:
        raise ValueError(f"--batch {batch} must be a multiple of the data size {grid.data_size}")
    if precision not in TOLERANCE:
        raise ValueError(f"--precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    dtype = torch.float64 if precision == "fp64" else torch.float32
    torch.manual_seed(seed)
    serial = EveryLayer(size=size).to(grid.device, dtype)
    model = copy.deepcopy(serial)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, 2, size, size, size, generator=gen).to(grid.device, dtype)
    seg_target = torch.randn(batch, 3, size // 2, size // 2, size // 2, generator=gen).to(grid.device, dtype)
    vec_target = torch.randn(batch, 4, generator=gen).to(grid.device, dtype)

    xs = x.clone().requires_grad_(True)
    with _arithmetic(precision, grid.device):
        seg_ref, vec_ref = serial(xs)
    (((seg_ref.to(dtype) * seg_target).sum() + (vec_ref.to(dtype) * vec_target).sum()) / batch).backward()

    pmodel = parallelize(model, grid, sync_batchnorm=True)
    xl = scatter(x, grid).requires_grad_(True)
    with _arithmetic(precision, grid.device):
        seg, vec = pmodel(xl)
    seg, vec = seg.to(dtype), vec.to(dtype)
    r0, r1 = grid.batch_range(batch)
    rows = r1 - r0
    (((seg * scatter(seg_target, grid)).sum() + (vec * vec_target[r0:r1]).sum()) / rows).backward()

    seg_all, vec_all = gather(seg.detach(), grid), gather(vec.detach(), grid)
    grad_x = gather(xl.grad, grid) * (rows / batch)  # each group's loss is a mean over its rows
    diffs = {"segmentation": _rel(seg_all, seg_ref.detach()), "vector": _rel(vec_all, vec_ref.detach()),
             "input grad": _rel(grad_x, xs.grad)}
    serial_grads = dict(serial.named_parameters())
    # A Flatten+Linear weight sharded at the first forward: its gradient gathered whole (collective).
    grads = {n: whole(p, p.grad) for n, p in pmodel.module.named_parameters()}
    diffs.update({f"grad {n}": _rel(g, serial_grads[n].grad) for n, g in grads.items()})
    return {
        "world_size": grid.world_size, "data": grid.data_size, "spatial": list(grid.spatial),
        "launcher": grid.launcher, "device": str(grid.device), "backend": grid.backend, "precision": precision,
        "tolerance": TOLERANCE[precision],
        "checksums": {
            "segmentation": float(seg_all.double().sum()), "vector": float(vec_all.double().sum()),
            "input grad": float(grad_x.double().abs().sum()),
            "param grads": float(sum(g.double().abs().sum() for g in grads.values())),
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
    ap.add_argument("--precision", choices=PRECISIONS, default="fp32",
                    help="arithmetic: fp64, fp32 (default), tf32 (GPUs), bf16 or fp16 (autocast)")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="max relative difference (default: the precision's, "
                         + ", ".join(f"{k} {v:g}" for k, v in TOLERANCE.items()) + ")")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    grid = init(spatial=args.spatial, timeout_s=120, tf32=args.precision == "tf32")
    try:
        report = run(grid, batch=args.batch, size=args.size, precision=args.precision)
    except BaseException:
        destroy(sync=False)  # the others may not get as far as destroy()
        raise
    destroy()
    tolerance = TOLERANCE[args.precision] if args.tolerance is None else args.tolerance
    report["tolerance"] = tolerance
    report["ok"] = report["max_rel_diff"] <= tolerance
    if grid.rank == 0:
        print(json.dumps(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
