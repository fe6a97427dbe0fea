"""Cheaper K-FAC factor updates, measured: what each costs the preconditioned gradient, and
what it saves in time.

    python scripts/kfac_cheap.py error --model cosmoflow --steps 20
    python scripts/kfac_cheap.py error --model unet3d --steps 20
    python scripts/kfac_cheap.py time --model unet3d --trials 5

``error`` trains the family's quickstart network (32^3 samples, float64, serial) for
``--steps`` SGD steps on its synthetic samples while several K-FAC optimisers on the same
model accumulate their factors every step (no eigendecompositions on the way): the exact
one, and one per cheap setting (``kfac.position_stride`` s, ``kfac.gram_dtype``). Then, on
the raw gradient of one more batch, it reports for each setting and damping the relative
error ``|P - P_exact| / |P_exact|`` of the whole model's preconditioned gradient (every
layer's ``(G + damping)^-1 V (A + damping)^-1`` through both eigenbases, concatenated)
against the exact factors', and the largest relative error of one factor. For intervals it
preconditions with the exact factors as they were ``lag`` updates earlier (a factor
interval of ``k`` uses factors up to ``k - 1`` steps old), beside the relative change of
the running factors between consecutive updates that ``kfac.stale_tol`` compares (median
over the last half of the steps). ``|P_exact - v / damping| / |P_exact|`` says how far
K-FAC is from the plain step at that damping (near 0: the curvature is small against the
damping, and any approximation of it looks good).

``time`` times, float32, one process, interleaved trials, the forward and backward of a
quickstart batch with each setting's factor capture armed plus its ``update_factors``,
against the same forward and backward unarmed: the difference is one factor update. One
JSON line per measurement on stdout, then a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.kfac import KFAC, KFACConfig  # noqa: E402
from parallel.kfac.inverse import eigen, precondition  # noqa: E402

# name -> KFACConfig settings over the exact ones
SETTINGS: dict[str, dict[str, Any]] = {
    "stride 2": {"position_stride": 2},
    "stride 3": {"position_stride": 3},
    "bf16 products": {"gram_dtype": "bfloat16"},
    "stride 2 + bf16": {"position_stride": 2, "gram_dtype": "bfloat16"},
}
BATCH = {"cosmoflow": 16, "unet3d": 4}  # the quickstarts' global batches


def family(name: str, dtype: torch.dtype) -> tuple[torch.nn.Module, Any, Any]:
    """(model, batch maker, loss) of a family's quickstart network at 32^3."""
    import parallel
    from parallel.job import family as families

    fam = families.get(name)
    grid = parallel.Grid((1, 1, 1), 1, 0)
    if name == "cosmoflow":
        from cosmoflow.model import CosmoFlow, CosmoFlowConfig

        model = CosmoFlow(CosmoFlowConfig(input_shift=3.8, input_scale=2.27, conv_filters=8, n_conv_blocks=4,
                                          dense_sizes=[64, 32], dropout=0.0), (32,) * 3)
    else:
        from unet3d.model import UNet3D, UNet3DConfig

        model = UNet3D(UNet3DConfig(depth=3, base_filters=8, max_filters=32))

    def sample(index: int) -> dict[str, Any]:
        if name == "cosmoflow":
            return fam.synthetic(0, 0, index, 32)
        from unet3d import synthetic

        image, label = synthetic.case(0, 0, index, 32)
        return {"image": image, "label": label}

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = BATCH[name]
        rows = [fam.transform({k: torch.from_numpy(v) for k, v in sample(step * n + i).items()}) for i in range(n)]
        x = torch.stack([r[fam.input_field] for r in rows]).to(dtype)
        y = torch.stack([r[fam.target_field] for r in rows])
        return x, (y.to(dtype) if y.is_floating_point() else y.long())

    return model.to(dtype), batch, lambda out, y: fam.loss(out, y, grid)


def _config(**kw: Any) -> KFACConfig:
    return KFACConfig(**{"factor_interval": 1, "inverse_interval": 10**6, "max_factor_dim": 10**6, "kl_clip": 0.0,
                         **kw})


def _preconditioned(opt: KFAC, factors: dict[str, tuple[torch.Tensor, torch.Tensor]], grads: dict[str, torch.Tensor],
                    damping: float) -> torch.Tensor:
    parts = []
    for layer in opt.layers:
        a, g = factors[layer.key]
        parts.append(precondition(grads[layer.key], eigen(a.double(), torch.float64), eigen(g.double(), torch.float64),
                                  damping).reshape(-1))
    return torch.cat(parts)


def _factor_error(exact: dict[str, tuple[torch.Tensor, torch.Tensor]],
                  other: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> float:
    return max(float((o.double() - e).norm() / e.norm()) for key in exact for e, o in zip(exact[key], other[key]))


def cmd_error(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model, batch, loss = family(args.model, torch.float64)
    exact = KFAC(model, None, _config(factor_decay=args.decay), lr=args.lr, momentum=0.9)
    cheap = {name: KFAC(model, None, _config(factor_decay=args.decay, **kw), lr=args.lr, momentum=0.9)
             for name, kw in SETTINGS.items() if name in args.settings}
    history: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    changes: list[float] = []
    for step in range(args.steps):  # SGD steps, every optimiser accumulating its factors
        exact.zero_grad()
        for opt in cheap.values():
            opt.recorder.clear()
        x, y = batch(step)
        loss(model(x), y).backward()
        for opt in (exact, *cheap.values()):
            opt.update_factors()
            opt.recorder.clear()
            opt.recorder.arm(True)
        torch.optim.SGD.step(exact)
        history.append({k: (a.clone(), g.clone()) for k, (a, g) in exact.factors.items()})
        if exact.staleness.history:
            changes.append(exact.staleness.history[-1][1])
    exact.zero_grad()
    x, y = batch(args.steps)
    loss(model(x), y).backward()
    grads = {layer.key: layer.grad_matrix().double() for layer in exact.layers}  # type: ignore[union-attr]
    v = torch.cat([grads[layer.key].reshape(-1) for layer in exact.layers])
    late = changes[len(changes) // 2:]
    rows = []
    for damping in args.damping:
        ref = _preconditioned(exact, exact.factors, grads, damping)
        base = {"model": args.model, "steps": args.steps, "damping": damping,
                "dense_vs_plain": float((ref - v / damping).norm() / ref.norm())}
        for name, opt in cheap.items():
            p = _preconditioned(exact, opt.factors, grads, damping)
            rows.append({**base, "setting": name, "rel_error": float((p - ref).norm() / ref.norm()),
                         "factor_rel_error": _factor_error(exact.factors, opt.factors)})
        for lag in args.lags:
            if lag >= len(history):
                continue
            old = history[-1 - lag]
            p = _preconditioned(exact, old, grads, damping)
            rows.append({**base, "setting": f"factors {lag} updates old", "rel_error": float((p - ref).norm() / ref.norm()),
                         "factor_rel_error": _factor_error(exact.factors, old),
                         "change_per_update_median": statistics.median(late) if late else None})
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def cmd_time(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model, batch, loss = family(args.model, torch.float32)
    names = ["exact"] + [n for n in SETTINGS if n in args.settings]
    opts = {name: KFAC(model, None, _config(**SETTINGS.get(name, {})), lr=0.0, momentum=0.0) for name in names}
    x, y = batch(0)

    def run(armed: str | None) -> float:
        for name, opt in opts.items():
            opt.zero_grad()
            opt.recorder.arm(name == armed)
        t0 = time.perf_counter()
        loss(model(x), y).backward()
        if armed is not None:
            opts[armed].update_factors()
        return time.perf_counter() - t0

    for name in [None, *names]:  # warm up
        run(name)
    seconds: dict[str, list[float]] = {name: [] for name in ["plain", *names]}
    for trial in range(args.trials):  # interleaved, the order turned each trial
        order = [None, *names] if trial % 2 == 0 else [*names, None][::-1]
        for name in order:
            seconds[name or "plain"].append(run(name))
    plain = statistics.median(seconds["plain"])
    rows = []
    for name in names:
        s = statistics.median(seconds[name])
        row = {"model": args.model, "batch": BATCH[args.model], "setting": name, "fwd_bwd_s": plain,
               "with_factor_update_s": s, "factor_update_s": s - plain, "trials": args.trials}
        print(json.dumps(row), flush=True)
        rows.append(row)
    exact = next(r for r in rows if r["setting"] == "exact")["factor_update_s"]
    for row in rows:
        row["vs_exact"] = row["factor_update_s"] / exact if exact > 0 else None
    return rows


def table(kind: str, rows: list[dict[str, Any]]) -> str:
    if kind == "error":
        head = "| model | damping | setting | rel. error of P | largest factor rel. error | median change per update | dense vs plain |"
        lines = [head, "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            change = r.get("change_per_update_median")
            lines.append(f"| {r['model']} | {r['damping']:g} | {r['setting']} | {r['rel_error']:.2e} | "
                         f"{r['factor_rel_error']:.2e} | {'' if change is None else f'{change:.2e}'} | "
                         f"{r['dense_vs_plain']:.2f} |")
        return "\n".join(lines)
    head = "| model | batch | setting | fwd+bwd, s | one factor update, s | over exact |"
    lines = [head, "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} | {r['setting']} | {r['fwd_bwd_s']:.3f} | "
                     f"{r['factor_update_s']:.3f} | {r['vs_exact']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("error", "time"):
        s = sub.add_parser(name)
        s.add_argument("--model", choices=list(BATCH), default="cosmoflow")
        s.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    e = sub.choices["error"]
    e.add_argument("--steps", type=int, default=20)
    e.add_argument("--lr", type=float, default=0.02)
    e.add_argument("--decay", type=float, default=0.95, help="kfac.factor_decay")
    e.add_argument("--damping", type=float, nargs="+", default=[1e-3, 1e-1, 1.0])
    e.add_argument("--lags", type=int, nargs="+", default=[1, 4, 9])
    sub.choices["time"].add_argument("--trials", type=int, default=5)
    args = p.parse_args(argv)
    rows = cmd_error(args) if args.cmd == "error" else cmd_time(args)
    print(table(args.cmd, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
