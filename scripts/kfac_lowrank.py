"""Low-rank K-FAC factors against dense ones: error against rank, cost against width.

    python scripts/kfac_lowrank.py error --model cosmoflow --size 64 --steps 6 --ranks 32 128 512
    python scripts/kfac_lowrank.py error --model unet3d --size 32 --steps 6 --ranks 32 128 512
    python scripts/kfac_lowrank.py cost --widths 1025 4097 16385 32769 --rank 128 --dense-up-to 4097

``error`` trains the model serially for ``--steps`` SGD steps on the family's synthetic
samples (batch 2) while K-FAC accumulates its dense factors every step (no
eigendecompositions on the way), then takes each layer's running factors and the raw
gradient of one more batch, and for every factor at least ``--min-width`` wide reports
the relative error ``|P_r - P| / |P|`` of the preconditioned gradient with that factor held
at rank r plus diagonal (``parallel.kfac.lowrank``: the same sketch, Nystrom form and
Woodbury solve as a run) against dense K-FAC's ``P``, for each damping, beside
``|P - v / damping| / |P|``, how far dense K-FAC is from the plain step there (near 0:
the curvature is small against the damping, and any approximation of it looks good).

``cost`` times, on a synthetic factor of each width (rows with a decaying spectrum; the
other factor 128 wide, as CosmoFlow's head's G), the low-rank path's pieces: the sketch
of one factor update from 64 rows, the Nystrom form, the Woodbury cores, one
preconditioning; and the dense eigendecomposition where the width is at most
``--dense-up-to``. Memory per rank is counted (``lowrank.memory_elements``; dense: the
factor, its running sum, eigenvectors and the packed all-reduce buffer, 3.5 d^2).
One JSON line per measurement on stdout, then a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.kfac import KFAC, KFACConfig, lowrank  # noqa: E402
from parallel.kfac.inverse import eigen, precondition  # noqa: E402


def _family(name: str, size: int) -> tuple[torch.nn.Module, Any, Any]:
    """(model, batch maker, loss) of a family at ``size``^3, float64."""
    import parallel
    from parallel.job import family

    fam = family.get(name)
    grid = parallel.Grid((1, 1, 1), 1, 0)
    if name == "cosmoflow":
        from cosmoflow.model import CosmoFlow, CosmoFlowConfig

        model = CosmoFlow(CosmoFlowConfig(input_shift=3.8, input_scale=2.27, dropout=0.0), (size,) * 3)
    else:
        from unet3d.model import UNet3D, UNet3DConfig

        model = UNet3D(UNet3DConfig(depth=3, base_filters=16, max_filters=128))

    def sample(index: int) -> dict[str, Any]:
        if name == "cosmoflow":
            return fam.synthetic(0, 0, index, size)
        from unet3d import synthetic

        image, label = synthetic.case(0, 0, index, size)
        return {"image": image, "label": label}

    def batch(step: int, n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [fam.transform({k: torch.from_numpy(v) for k, v in sample(step * n + i).items()}) for i in range(n)]
        x = torch.stack([r[fam.input_field] for r in rows]).double()
        y = torch.stack([r[fam.target_field] for r in rows])
        return x, (y.double() if y.is_floating_point() else y.long())

    return model.double(), batch, lambda out, y: fam.loss(out, y, grid)


def cmd_error(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model, batch, loss = _family(args.model, args.size)
    cfg = KFACConfig(damping=args.damping[0], factor_interval=1, inverse_interval=10**6, max_factor_dim=10**6,
                     kl_clip=0.0)
    opt = KFAC(model, None, cfg, lr=args.lr, momentum=0.9)
    flat_shapes: dict[str, tuple[int, ...]] = {}  # (C, D, H, W) flattened into a Linear after a Flatten
    for prefix, mod in model.named_modules():
        kids = list(mod.named_children()) if isinstance(mod, torch.nn.Sequential) else []
        for (_, a), (name, b) in zip(kids, kids[1:]):
            if isinstance(a, torch.nn.Flatten) and isinstance(b, torch.nn.Linear):
                key = f"{prefix}.{name}" if prefix else name
                a.register_forward_hook(lambda m, i, o, key=key: flat_shapes.update({key: tuple(i[0].shape[1:])}))
    for step in range(args.steps):  # SGD steps accumulating the factors (no eigendecompositions on the way)
        opt.zero_grad()
        x, y = batch(step)
        loss(model(x), y).backward()
        opt.update_factors()
        torch.optim.SGD.step(opt)
        opt.recorder.clear()
        opt.recorder.arm(True)
    opt.zero_grad()
    x, y = batch(args.steps)
    loss(model(x), y).backward()
    rows = []
    for layer in opt.layers:
        a, g = opt.factors[layer.key]
        side = "A" if layer.dim_a >= layer.dim_g else "G"
        wide, other = (a, g) if side == "A" else (g, a)
        d = wide.shape[0]
        if d < args.min_width:
            continue
        v = layer.grad_matrix().double()  # type: ignore[union-attr]
        t0 = time.perf_counter()
        ew, eo = eigen(wide, torch.float64), eigen(other, torch.float64)
        dense_s = time.perf_counter() - t0
        for damping in args.damping:
            ref = precondition(v, ew, eo, damping) if side == "A" else precondition(v, eo, ew, damping)
            # how far dense K-FAC is from the plain step's direction (v / damping): where the
            # curvature is small against the damping, any approximation of it looks good
            curvature = float((ref - v / damping).norm() / ref.norm())
            for r in args.ranks:
                if r >= d:
                    continue
                m = lowrank.sketch_width(d, r, args.oversample)
                om = lowrank.omega(layer.key, d, m, torch.float64, wide.device)
                t0 = time.perf_counter()
                f = lowrank.nystrom(torch.cat([wide @ om, wide.diagonal()[:, None]], dim=1), om, r, 0.0,
                                    torch.float64)
                s = lowrank.cores(f, eo[1], damping)
                low_s = time.perf_counter() - t0
                p = lowrank.precondition(v, side, f, eo, s, damping)
                err = float((p - ref).norm() / ref.norm())
                if layer.name in flat_shapes and side == "A":  # the hierarchical form, spatial blocks as leaves
                    sketch = torch.cat([wide @ om, wide.diagonal()[:, None]], dim=1)
                    for split in args.blocks:
                        idx = _spatial_blocks(flat_shapes[layer.name], split, d)
                        hf = lowrank.blocked(sketch, om, [(i, wide[i][:, i]) for i in idx], r, torch.float64)
                        hp = lowrank.blocked_precondition(v, hf, eo, lowrank.blocked_cores(hf, eo[1], damping),
                                                          damping)
                        hrow = {"model": args.model, "size": args.size, "layer": f"{layer.name} blocks {split}",
                                "factor": side, "width": d, "other": other.shape[0], "damping": damping, "rank": r,
                                "rel_error": float((hp - ref).norm() / ref.norm()), "dense_vs_plain": curvature}
                        print(json.dumps(hrow), flush=True)
                        rows.append(hrow)
                cos = float((p * ref).sum() / (p.norm() * ref.norm()))
                row = {"model": args.model, "size": args.size, "layer": layer.name, "factor": side, "width": d,
                       "other": other.shape[0], "damping": damping, "rank": r, "rel_error": err, "cosine": cos,
                       "dense_vs_plain": curvature,
                       "lowrank_s": low_s, "dense_eigh_s": dense_s}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def _spatial_blocks(shape: tuple[int, ...], split: str, width: int) -> list[torch.Tensor]:
    """Feature indices of each spatial block of a flattened (C, D, H, W) input split
    ``split`` ("2x2x1") along D, H, W; the bias feature (if any) a block of its own."""
    c, *dims = shape
    parts = [int(v) for v in split.split("x")]
    pos = torch.arange(c * dims[0] * dims[1] * dims[2]).view(c, *dims)
    out = []
    for bd in torch.tensor_split(torch.arange(dims[0]), parts[0]):
        for bh in torch.tensor_split(torch.arange(dims[1]), parts[1]):
            for bw in torch.tensor_split(torch.arange(dims[2]), parts[2]):
                out.append(pos[:, bd][:, :, bh][:, :, :, bw].reshape(-1).sort().values)
    if width > pos.numel():
        out.append(torch.arange(pos.numel(), width))
    return out


def _synthetic_rows(n: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """(n, d) rows whose Gram matrix has a decaying spectrum (smooth features, as pooled volumes)."""
    x = torch.randn(n, d, generator=gen, dtype=torch.float32)
    return x * (1.0 + torch.arange(d, dtype=torch.float32) / 64.0) ** -0.75


def cmd_cost(args: argparse.Namespace) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    n_other, damping = 128, 1e-3
    other = torch.randn(n_other, n_other + 8, generator=gen)
    eo = eigen(other @ other.t() / n_other, torch.float32)
    for d in args.widths:
        x = _synthetic_rows(64, d, gen)
        r = min(args.rank, d)
        m = lowrank.sketch_width(d, r, args.oversample)
        om = lowrank.omega("cost", d, m, torch.float32, x.device)
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        sk = lowrank.sketch_rows(x.t(), om) / 64.0
        timings["sketch_update_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        f = lowrank.nystrom(sk, om, r, 0.0, torch.float32)
        timings["nystrom_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        s = lowrank.cores(f, eo[1], damping)
        timings["cores_s"] = time.perf_counter() - t0
        v = torch.randn(n_other, d, generator=gen)
        t0 = time.perf_counter()
        lowrank.precondition(v, "A", f, eo, s, damping)
        timings["precondition_s"] = time.perf_counter() - t0
        row = {"width": d, "rank": r, "sketch": m, **timings,
               "lowrank_memory_bytes": 4 * lowrank.memory_elements(d, n_other, r, args.oversample),
               "dense_memory_bytes": 4 * 3.5 * d * d, "dense_eigh_s": None}
        if d <= args.dense_up_to:
            t0 = time.perf_counter()
            eigen(x.t() @ x / 64.0 + 1e-6 * torch.eye(d), torch.float32)
            row["dense_eigh_s"] = time.perf_counter() - t0
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def table(kind: str, rows: list[dict[str, Any]]) -> str:
    if kind == "error":
        ranks = sorted({r["rank"] for r in rows})
        head = ("| model | layer | factor (width; other) | damping | dense vs plain | "
                + " | ".join(f"rank {r}" for r in ranks) + " |")
        lines = [head, "|" + " --- |" * (5 + len(ranks))]
        keys = sorted({(r["model"], r["layer"], r["factor"], r["width"], r["other"], r["damping"]) for r in rows},
                      key=lambda k: (k[0], -k[3], k[5]))
        for k in keys:
            mine = [r for r in rows if (r["model"], r["layer"], r["factor"], r["width"], r["other"], r["damping"]) == k]
            got = {r["rank"]: r["rel_error"] for r in mine}
            cells = [f"{got[r]:.3f}" if r in got else "-" for r in ranks]
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} ({k[3]}; {k[4]}) | {k[5]:g} | {mine[0]['dense_vs_plain']:.3f} | "
                         + " | ".join(cells) + " |")
        return "\n".join(lines)
    lines = ["| width | rank | sketch update (s) | Nystrom (s) | cores (s) | precondition (s) | memory low rank (MB) "
             "| memory dense (MB) | dense eigh (s) |", "|" + " --- |" * 9]
    for r in rows:
        eig = f"{r['dense_eigh_s']:.2f}" if r["dense_eigh_s"] is not None else "-"
        lines.append(f"| {r['width']} | {r['rank']} | {r['sketch_update_s']:.3f} | {r['nystrom_s']:.3f} | "
                     f"{r['cores_s']:.3f} | {r['precondition_s']:.4f} | {r['lowrank_memory_bytes'] / 1e6:.1f} | "
                     f"{r['dense_memory_bytes'] / 1e6:.0f} | {eig} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("error", help="relative error of the preconditioned gradient against rank")
    e.add_argument("--model", choices=["cosmoflow", "unet3d"], default="cosmoflow")
    e.add_argument("--size", type=int, default=64)
    e.add_argument("--steps", type=int, default=6)
    e.add_argument("--lr", type=float, default=0.01)
    e.add_argument("--ranks", type=int, nargs="+", default=[32, 128, 512])
    e.add_argument("--oversample", type=int, default=16)
    e.add_argument("--damping", type=float, nargs="+", default=[1e-3, 1e-1])
    e.add_argument("--min-width", type=int, default=512)
    e.add_argument("--blocks", nargs="*", default=["2x1x1", "2x2x1", "2x2x2"],
                   help="spatial splits whose blocks are the leaves of the Flatten+Linear's hierarchical form")
    c = sub.add_parser("cost", help="time and memory of the low-rank path against width")
    c.add_argument("--widths", type=int, nargs="+", default=[1025, 4097, 16385, 32769])
    c.add_argument("--rank", type=int, default=128)
    c.add_argument("--oversample", type=int, default=16)
    c.add_argument("--dense-up-to", type=int, default=4097)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = cmd_error(args) if args.cmd == "error" else cmd_cost(args)
    print(table(args.cmd, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
