"""Segment cases with a trained 3D U-Net and write the labels to HDF5.

Each case is segmented by the code that scores the training's evaluation
(``parallel.infer.case_logits``), in either mode (default: the run's ``eval.mode``):

- ``--mode sliding``: the MLPerf Gaussian-weighted sliding window of ``--window`` (default:
  the run's ``eval.window``, else its ``data.crop``), overlap and padding as the run's
  ``eval`` section says (MLPerf: 0.5 and -2.2), every window split across the spatial
  group. It covers the whole case, so every voxel gets a label (the training's metric
  scores the reference's kept part, which drops a remainder under half a stride: the Dice
  logged here can differ slightly). A window larger than a case pads the case, centred, as
  the reference does; a window the network cannot take is refused by name.
- ``--mode whole``: one pass over each whole case across the spatial group (the case's
  sides must be multiples of the network's total stride).

Every rank reads only its block and writes its block of the labels (ranks take turns on
a file), so no rank ever holds a whole case. Output: one HDF5 file per input file in
``--out``, dataset ``label`` (N, D, H, W) uint8; where the inputs hold labels, the mean
Dice over the cases is logged.

    python -m unet3d.predict --run-dir runs/unet3d_quickstart --out seg/          # the run's data.dir, val split
    python -m unet3d.predict --run-dir RUN --data data/unet3d_quick --split train --out seg/
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 -m unet3d.predict \\
        --run-dir runs/unet3d_quickstart --data data/unet3d_quick/val --out seg/ --spatial 2 1 1
    mpirun -n 4 python -m unet3d.predict --run-dir RUN --data DIR --out seg/ --spatial 2 2 1 --window 64
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import h5py
import numpy as np
import torch

from parallel import comm
from parallel.data import BlockDataset
from parallel.data.crops import REGION_KEY
from parallel.grid import Grid
from parallel.infer import CaseRegion, WindowCrop, case_logits
from parallel.infer.predict import Session, UsageError, case_shapes, load_run, open_session, parser, run
from parallel.train.checks import window as eval_window
from parallel.train.checks.fit import Strides
from unet3d.family import FAMILY

log = logging.getLogger("parallel.predict")
PROG = "python -m unet3d.predict"


def main(argv: list[str] | None = None) -> int:
    p = parser(PROG, __doc__, "U-Net")
    p.add_argument("--out", type=Path, required=True, help="output directory (one label file per input file)")
    p.add_argument("--mode", choices=["sliding", "whole"], default=None, help="default: the run's eval.mode")
    p.add_argument("--window", type=int, nargs="+", default=None, metavar="N",
                   help="sliding window N (or D H W); default: the run's eval.window, else its data.crop")
    args = p.parse_args(argv)
    return run(PROG, lambda: _predict(args))


def _predict(args) -> None:  # noqa: ANN001 - argparse.Namespace
    job = load_run(args, FAMILY)
    mode = args.mode or str(job.eval.mode)
    window = _window(args.window, job) if mode == "sliding" else None
    regions = WindowCrop(window, job.eval.overlap, drop_remainder=False) if window else CaseRegion()
    s = open_session(args, FAMILY, regions, job)
    grid = s.grid
    # every rank checks every case before any runs: a refusal is the same on all of them
    strides = Strides(FAMILY, job.model, 1, grid)
    if window is not None:
        checked = [(window, f"--window {' '.join(map(str, window))}")]
    else:
        checked = [(shape, f"{path} {list(shape)} (--mode whole; --mode sliding takes any case)")
                   for path, shape in case_shapes(s.dataset)]
    for volume, what in checked:
        problems = strides.problems(volume, what)
        if problems:
            raise UsageError(problems[0])
    pmodel = s.model(window or checked[0][0])
    args.out.mkdir(parents=True, exist_ok=True)
    sums = torch.zeros(2, dtype=torch.float64)
    # data groups take cases round-robin; each round the ranks write in turns over the whole
    # job, because two data groups may hold cases of the same output file
    ds = s.dataset
    for r in range(-(-len(ds) // grid.data_size)):
        index = r * grid.data_size + grid.data_rank
        labels, shape = None, None
        if index < len(ds):
            sample = ds[index]
            shape = tuple(int(v) for v in sample[REGION_KEY][3:])
            x = sample[FAMILY.input_field][None].to(grid.device)
            logits = case_logits(pmodel, x, grid, mode=mode, region=sample[REGION_KEY],  # type: ignore[arg-type]
                                 window=window, overlap=job.eval.overlap, pad_value=job.eval.pad_value,
                                 sigma_scale=job.eval.sigma_scale)
            if s.has_target:
                y = sample[FAMILY.target_field][None].to(grid.device)
                sums += torch.tensor([float(FAMILY.metric(logits, y, grid)[0]), 1.0], dtype=torch.float64)
            labels = logits.argmax(1)[0].to(torch.uint8).cpu().numpy()
        _write_block(args.out, ds, index, labels, grid, shape)
    _report(s, sums, args.out)


def _window(given: list[int] | None, job) -> tuple[int, int, int]:  # noqa: ANN001 - the job config
    if given is not None:
        if len(given) not in (1, 3) or min(given) < 1:
            raise UsageError(f"--window {' '.join(map(str, given))}: want N or D H W, positive")
        return tuple(given * 3 if len(given) == 1 else given)  # type: ignore[return-value]
    w = eval_window(job.eval, job.data.crop)
    if w is None:
        raise UsageError("the run has neither eval.window nor data.crop: give --window N (or --mode whole)")
    return w


def _report(s: Session, sums: torch.Tensor, out: Path) -> None:
    grid = s.grid
    if s.has_target:
        device = comm.group_device(grid.data_group)
        total = sums.to(device)
        if grid.data_size > 1:
            comm.all_reduce_(total, grid.data_group, caller="unet3d.predict")
        if grid.rank == 0:
            log.info("mean Dice over %d cases: %.4f", int(total[1]), float(total[0] / max(float(total[1]), 1.0)))
    if grid.rank == 0:
        log.info("labels written to %s", out)


def _write_block(out: Path, ds: BlockDataset, index: int, labels: np.ndarray | None, grid: Grid,
                 volume: tuple[int, ...] | None) -> None:
    """Every rank of the job writes its block of case ``index`` in turn (None: nothing to write)."""
    for turn in range(grid.world_size):
        if turn == grid.rank and labels is not None and volume is not None:
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
    sys.exit(main())
