"""Segment whole volumes with a trained 3D U-Net and write the labels to HDF5.

Default (``--window 0``): each volume is segmented in one pass across the spatial group.
Every rank reads only its block, the group runs the network on the distributed volume
(halos come from neighbours), and each rank writes the argmax of its own block into the
output file (ranks of a group take turns), so no rank ever holds the whole volume: no
sliding window is needed wherever the group's memory holds the volume.

``--window N``: a Gaussian-weighted sliding window of N^3 (overlap 0.5, sigma 0.125 N,
padding -2.2 as in the MLPerf evaluation) for volumes larger than that; each data group
takes whole volumes and each window runs on one rank (use it with ``--spatial 1 1 1``).

Output: one HDF5 file per input file in ``--out``, dataset ``label`` (N, D, H, W) uint8.

    python -m unet3d.predict --run-dir runs/unet3d_quickstart --data data/unet3d_quick/val --out seg/
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 -m unet3d.predict \\
        --run-dir runs/unet3d_quickstart --data data/unet3d_quick/val --out seg/ --spatial 2 1 1
    mpirun -n 4 python -m unet3d.predict --run-dir RUN --data DIR --out seg/ --spatial 2 2 1
    python -m unet3d.predict --run-dir RUN --data DIR --out seg/ --window 64
"""

from __future__ import annotations

import argparse
import itertools
import logging
from pathlib import Path

import h5py
import numpy as np
import torch
from torch import nn

import parallel
from parallel import comm
from parallel.data import BlockDataset
from parallel.train import checkpoint
from parallel.train.cli import load_job
from unet3d.family import FAMILY

log = logging.getLogger("parallel.predict")
PAD_VALUE = -2.2


def gaussian_importance(size: int, sigma_scale: float = 0.125) -> torch.Tensor:
    """(size, size, size) Gaussian weights centred in the window, max 1."""
    x = torch.arange(size, dtype=torch.float32) - (size - 1) / 2
    g = torch.exp(-0.5 * (x / (sigma_scale * size)) ** 2)
    w = g[:, None, None] * g[None, :, None] * g[None, None, :]
    return (w / w.max()).clamp(min=1e-4)


@torch.no_grad()
def sliding_window(model: nn.Module, image: torch.Tensor, window: int, classes: int,
                   overlap: float = 0.5) -> torch.Tensor:
    """Gaussian-weighted sliding-window logits average of ``image`` (1, C, D, H, W)."""
    dims = image.shape[2:]
    pad = [max(window - d, 0) for d in dims]
    x = nn.functional.pad(image, [0, pad[2], 0, pad[1], 0, pad[0]], value=PAD_VALUE)
    full = x.shape[2:]
    step = max(1, int(window * (1 - overlap)))
    starts = [sorted({*range(0, f - window + 1, step), f - window}) for f in full]
    w = gaussian_importance(window).to(image.device)
    acc = torch.zeros(1, classes, *full, device=image.device)
    norm = torch.zeros(1, 1, *full, device=image.device)
    for d, h, ww in itertools.product(*starts):
        sl = (slice(None), slice(None), slice(d, d + window), slice(h, h + window), slice(ww, ww + window))
        acc[sl] += torch.softmax(model(x[sl]).float(), 1) * w
        norm[sl] += w
    out = acc / norm
    return out[:, :, : dims[0], : dims[1], : dims[2]]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m unet3d.predict", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", dest="run", type=Path, required=True, help="training run.dir")
    p.add_argument("--checkpoint", type=Path, default=None, help="default: RUN/checkpoints/last.pt")
    p.add_argument("--data", type=Path, required=True, help="directory (or file) of U-Net sample files")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--spatial", type=int, nargs=3, default=[1, 1, 1], metavar=("SD", "SH", "SW"))
    p.add_argument("--window", type=int, default=0, help="sliding-window size (0: whole volume)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    job = load_job(args.run, FAMILY)
    grid = parallel.init(args.spatial)
    try:
        if args.window and grid.spatial_size > 1:
            raise ValueError(f"--window {args.window} runs each window on one rank: use --spatial 1 1 1, "
                             f"not {args.spatial}")
        ds = BlockDataset(args.data, fields=None, grid=grid)
        ds.transform = FAMILY.transform_for(ds.attrs) if FAMILY.transform_for else FAMILY.transform
        has_label = FAMILY.target_field in ds.fields
        ds.fields = tuple(f for f in (FAMILY.input_field, FAMILY.target_field) if f in ds.fields)
        volume = tuple(int(s) for s in ds.attrs["global_shape"])
        model = FAMILY.build_model(job.model, volume) if not args.window else FAMILY.build_model(
            job.model, (args.window,) * 3)
        ckpt = checkpoint.load(args.checkpoint or checkpoint.checkpoint_path(args.run), grid.device)
        model.load_state_dict(ckpt["model"])
        pmodel = parallel.parallelize(model, grid, seed=0).eval()
        args.out.mkdir(parents=True, exist_ok=True)
        dice = []
        # Data groups take volumes round-robin; in each round the ranks write in turns over
        # the whole job, because two data groups may hold volumes of the same output file.
        rounds = -(-len(ds) // grid.data_size)
        for r in range(rounds):
            index = r * grid.data_size + grid.data_rank
            labels = None
            if index < len(ds):
                sample = ds[index]
                x = sample[FAMILY.input_field][None].to(grid.device)
                with torch.no_grad():
                    if args.window:
                        logits = sliding_window(pmodel, x, args.window, job.model.n_classes)
                    else:
                        logits = pmodel(x)
                if has_label:
                    y = sample[FAMILY.target_field][None].to(grid.device)
                    dice.append(float(FAMILY.metric(logits, y, grid)[0]))
                labels = logits.argmax(1)[0].to(torch.uint8).cpu().numpy()
            _write_block(args.out, ds, index, labels, grid, volume)
        if has_label:
            device = comm.group_device(grid.data_group)
            scores = torch.tensor([sum(dice), len(dice)], dtype=torch.float64, device=device)
            if grid.data_size > 1:
                comm.all_reduce_(scores, grid.data_group)
            if grid.rank == 0:
                log.info("mean Dice over %d volumes: %.4f", int(scores[1]), scores[0] / max(scores[1], 1))
        if grid.rank == 0:
            log.info("labels written to %s", args.out)
    finally:
        parallel.destroy()


def _write_block(out: Path, ds: BlockDataset, index: int, labels: np.ndarray | None, grid: parallel.Grid,
                 volume: tuple[int, ...]) -> None:
    """Every rank of the job writes its block of sample ``index`` in turn (None: nothing to write)."""
    for turn in range(grid.world_size):
        if turn == grid.rank and labels is not None:
            path, row = ds.locate(index)
            (d0, d1), (h0, h1), (w0, w1) = (grid.block_range(volume) if grid.spatial_size > 1
                                            else [(0, n) for n in volume])
            with h5py.File(out / path.name, "a") as f:
                if "label" not in f:
                    f.create_dataset("label", shape=(row + 1, *volume), maxshape=(None, *volume),
                                     dtype="uint8", chunks=(1, *[min(64, n) for n in volume]))
                dset = f["label"]
                if dset.shape[0] <= row:
                    dset.resize(row + 1, axis=0)
                dset[row, d0:d1, h0:h1, w0:w1] = labels
        if grid.world_size > 1:
            comm.barrier(grid.world_group)


if __name__ == "__main__":
    main()
