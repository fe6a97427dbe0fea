"""Predict the 4 cosmological parameters of every sample of a directory, to CSV.

Each rank reads only its block of each sample; the spatial group computes the prediction
together (the model's replicated output), data groups take different samples, and rank 0
writes one CSV row per sample (file, row, 4 predictions; targets and absolute errors when
the files carry them).

Single process::

    python -m cosmoflow.predict --run-dir runs/cosmoflow_quickstart --out predictions.csv   # the run's data.dir, val
    python -m cosmoflow.predict --run-dir runs/cosmoflow_quickstart --data data/cosmoflow_quick/val \\
        --out predictions.csv

2 ranks splitting each sample in depth (torchrun / mpirun / srun alike)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 -m cosmoflow.predict \\
        --run-dir runs/cosmoflow_quickstart --data data/cosmoflow_quick/val --spatial 2 1 1
    mpirun -n 2 python -m cosmoflow.predict --run-dir runs/cf --data DIR --spatial 2 1 1
"""

from __future__ import annotations

import csv
import logging
import sys
from pathlib import Path

import torch

import parallel
from cosmoflow.family import FAMILY
from parallel import comm
from parallel.data import BlockDataset, ShardSampler, make_loader
from parallel.infer.predict import UsageError, open_session, parser, run

log = logging.getLogger("parallel.predict")
PARAMS = ("omega_m", "sigma_8", "n_s", "omega_b")
PROG = "python -m cosmoflow.predict"


def main(argv: list[str] | None = None) -> int:
    p = parser(PROG, __doc__, "CosmoFlow")
    p.add_argument("--out", type=Path, default=Path("predictions.csv"), help="the CSV to write")
    p.add_argument("--batch", type=int, default=4, help="samples per step over all data groups")
    args = p.parse_args(argv)
    return run(PROG, lambda: _predict(args))


def _predict(args) -> None:  # noqa: ANN001 - argparse.Namespace
    if args.batch < 1:
        raise UsageError(f"--batch {args.batch}: want >= 1")
    s = open_session(args, FAMILY)
    grid, ds = s.grid, s.dataset
    pmodel = s.model(tuple(int(v) for v in ds.attrs["global_shape"]))
    sampler = ShardSampler(len(ds), grid, per_step=max(args.batch // grid.data_size, 1))
    loader = make_loader(ds, sampler, num_workers=0, device=grid.device)
    rows: list[list[float]] = []
    with torch.no_grad():
        for indices, (batch, _) in zip(list(sampler), loader):
            x = batch[FAMILY.input_field]
            if x.shape[0] == 0:
                continue
            pred = pmodel(x).float().cpu()
            for i, idx in enumerate(indices):
                row = [float(idx), *pred[i].tolist()]
                if s.has_target:
                    row += batch[FAMILY.target_field][i].float().cpu().tolist()
                rows.append(row)
    width = 1 + 4 + (4 if s.has_target else 0)
    everything = _gather_rows(torch.tensor(rows, dtype=torch.float64).reshape(-1, width), grid)
    if grid.rank == 0:
        _write_csv(args.out, everything, ds, s.has_target)
        log.info("wrote %d predictions to %s", len(everything), args.out)


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
    sys.exit(main())
