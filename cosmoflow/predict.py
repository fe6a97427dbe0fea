"""Predict the 4 cosmological parameters of every sample of a directory, to CSV.

Each rank reads only its block of each sample; the spatial group computes the prediction
together (the model's replicated output), data groups take different samples, and rank 0
writes one CSV row per sample (file, row, 4 predictions; targets and absolute errors when
the files carry them).

Single process::

    python -m cosmoflow.predict --run-dir runs/cosmoflow_quickstart --data data/cosmoflow_quick/val \\
        --out predictions.csv

2 ranks splitting each sample in depth (torchrun / mpirun / srun alike)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 -m cosmoflow.predict \\
        --run-dir runs/cosmoflow_quickstart --data data/cosmoflow_quick/val --spatial 2 1 1
    mpirun -n 2 python -m cosmoflow.predict --run-dir runs/cf --data DIR --spatial 2 1 1
"""

from __future__ import annotations

import argparse
import csv
import logging
from pathlib import Path

import torch

import parallel
from parallel import comm
from cosmoflow.family import FAMILY
from parallel.data import BlockDataset, GlobalShuffleSampler, make_loader
from parallel.train import checkpoint
from parallel.train.cli import load_job

log = logging.getLogger("parallel.predict")
PARAMS = ("omega_m", "sigma_8", "n_s", "omega_b")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m cosmoflow.predict", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", dest="run", type=Path, required=True, help="training run.dir (config.yaml, checkpoints/last.pt)")
    p.add_argument("--checkpoint", type=Path, default=None, help="default: RUN/checkpoints/last.pt")
    p.add_argument("--data", type=Path, required=True, help="directory (or file) of CosmoFlow sample files")
    p.add_argument("--out", type=Path, default=Path("predictions.csv"))
    p.add_argument("--spatial", type=int, nargs=3, default=[1, 1, 1], metavar=("SD", "SH", "SW"))
    p.add_argument("--batch", type=int, default=4, help="samples per step over all data groups")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    job = load_job(args.run, FAMILY)
    grid = parallel.init(args.spatial)
    try:
        ds = BlockDataset(args.data, fields=None, grid=grid, transform=FAMILY.transform)
        has_target = FAMILY.target_field in ds.fields
        ds.fields = tuple(f for f in (FAMILY.input_field, FAMILY.target_field) if f in ds.fields)
        volume = tuple(int(s) for s in ds.attrs["global_shape"])
        model = FAMILY.build_model(job.model, volume)
        ckpt = checkpoint.load(args.checkpoint or checkpoint.checkpoint_path(args.run), grid.device)
        model.load_state_dict(ckpt["model"])
        pmodel = parallel.parallelize(model, grid, seed=0).eval()
        sampler = GlobalShuffleSampler(len(ds), grid, global_batch=max(args.batch, grid.data_size),
                                       shuffle=False, drop_last=False)
        loader = make_loader(ds, sampler, num_workers=0, device=grid.device)
        rows: list[list[float]] = []
        with torch.no_grad():
            for step, (batch, _) in enumerate(loader):
                x = batch[FAMILY.input_field]
                if x.shape[0] == 0:
                    continue
                pred = pmodel(x).float().cpu()
                indices = list(sampler.order(0)[step * sampler.global_batch:(step + 1) * sampler.global_batch])
                a, b = grid.batch_range(len(indices)) if len(indices) >= grid.data_size else (0, len(indices))
                for i, idx in enumerate(indices[a:b]):
                    row = [float(idx), *pred[i].tolist()]
                    if has_target:
                        row += batch[FAMILY.target_field][i].float().cpu().tolist()
                    rows.append(row)
        width = 1 + 4 + (4 if has_target else 0)
        mine = torch.tensor(rows, dtype=torch.float64).reshape(-1, width)
        everything = _gather_rows(mine, grid)
        if grid.rank == 0:
            _write_csv(args.out, everything, ds, has_target)
            log.info("wrote %d predictions to %s", len(everything), args.out)
    finally:
        parallel.destroy()


def _gather_rows(rows: torch.Tensor, grid: parallel.Grid) -> torch.Tensor:
    """Every data group's rows on rank 0 (spatial ranks hold the same rows: take one each)."""
    if grid.world_size == 1:
        return rows
    parts = comm.all_gather_varlen(rows.to(comm.group_device(grid.world_group)), grid.world_group)
    keep = [parts[r].cpu() for r in range(0, grid.world_size, grid.spatial_size)]
    merged = torch.cat(keep)
    return merged[merged[:, 0].argsort()]


def _write_csv(path: Path, rows: torch.Tensor, ds: BlockDataset, has_target: bool) -> None:
    header = ["file", "row", *(f"pred_{p}" for p in PARAMS)]
    if has_target:
        header += [*(f"true_{p}" for p in PARAMS), *(f"abs_err_{p}" for p in PARAMS)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        for r in rows.tolist():
            file, row = ds.locate(int(r[0]))
            out = [file.name, row, *(f"{v:.6f}" for v in r[1:5])]
            if has_target:
                out += [f"{v:.6f}" for v in r[5:9]] + [f"{abs(a - b):.6f}" for a, b in zip(r[1:5], r[5:9])]
            w.writerow(out)


if __name__ == "__main__":
    main()
