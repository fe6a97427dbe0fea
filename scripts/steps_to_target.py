"""Steps to the quality target at several global batches, the S(B) model fitted on two of
them and checked on the others, and the in-run gradient noise scale beside the fitted B_noise.

    python scripts/steps_to_target.py --family cosmoflow --data data/c16 --batches 8,16,32,64 \\
        --fit-on 8,64 --seeds 0,1,2 --target 0.30 --lr 0.005 --lr-batch 16 --out docs/benchmarks/NAME

Each (batch, seed) trains serially (``python -m <family>.train``, the family's quickstart
config, constant learning rate scaled linearly with the batch: ``--lr`` x B / ``--lr-batch``,
evaluated every epoch, stopped at the target); the steps to the target are the step of the
first evaluation that reached it (an epoch's resolution). ``--noise-batches`` also trains
at those batches on ``--noise-ranks`` data groups (torchrun, no spatial split) to read the
run's measured B_simple (``summary.json``'s ``noise_scale``). Writes ``OUT.jsonl`` (one row
per run, then the fit), ``OUT.md`` (the table) and ``OUT.png`` (steps against batch,
measured and fitted; B_simple over training) when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.plan.target import StepsModel, fit  # noqa: E402


def _train(args: argparse.Namespace, batch: int, seed: int, ranks: int, run_dir: Path) -> dict:
    over = [f"data.dir={args.data}", f"train.global_batch_size={batch}", f"train.seed={seed}",
            f"optim.lr={args.lr}", f"optim.lr_scale_batch={args.lr_batch}", f"train.target={args.target}",
            f"train.epochs={args.max_epochs}", "train.stop_at_target=true", "train.eval_every=1",
            "sched.warmup_epochs=0", "sched.decay=none", f"run.dir={run_dir}", "run.progress=false",
            "run.tensorboard=false", "mlperf.enabled=false", "run.log_every=1", *args.set]
    launcher = [sys.executable, "-m"] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                          "--nproc-per-node", str(ranks), "-m"]
    cmd = ["nice", "-n", str(args.nice), *launcher, f"{args.family}.train", "--config-name", "quickstart", *over]
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}\nfailed ({done.returncode}):\n{done.stderr[-3000:]}")
    s = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reached = next((r["step"] for r in rows if r["kind"] == "eval" and _reached(r[s["metric"]], args)), None)
    noise = s.get("noise_scale") or {}
    trace = [[r["step"], r.get("noise_b_simple")] for r in rows if r["kind"] == "train" and "noise_b_simple" in r]
    return {"kind": "run", "batch": batch, "seed": seed, "ranks": ranks, "steps_to_target": reached,
            "best": s["best_metric"], "steps_run": s["steps"], "seconds": round(time.monotonic() - t0, 1),
            "b_simple": noise.get("b_simple"), "b_simple_run_mean": noise.get("b_simple_run_mean"),
            "b_simple_trace": trace}


def _reached(value: float, args: argparse.Namespace) -> bool:
    return value <= args.target if args.goal == "min" else value >= args.target


def _plot(path: Path, runs: list[dict], model: StepsModel, fit_on: list[int], batches: list[int]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for r in runs:
        if r["ranks"] == 1 and r["steps_to_target"] is not None:
            a.scatter(r["batch"], r["steps_to_target"], color="C0" if r["batch"] in fit_on else "C1", s=14)
    xs = [batches[0] * (batches[-1] / batches[0]) ** (i / 50) for i in range(51)]
    a.plot(xs, [model.steps(x) for x in xs], "k-", lw=1,
           label=f"S(B) = {model.s_min:.0f} (1 + {model.b_noise:.1f} / B)")
    a.scatter([], [], color="C0", label="measured, fitted on")
    a.scatter([], [], color="C1", label="measured, predicted")
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("global batch B")
    a.set_ylabel("steps to the target")
    a.legend(fontsize=7)
    for r in runs:
        if r["b_simple_trace"]:
            pts = [(s, v) for s, v in r["b_simple_trace"] if v is not None]
            b.plot([p[0] * r["batch"] for p in pts], [p[1] for p in pts], lw=1,
                   label=f"B = {r['batch']}, data {r['ranks']}, seed {r['seed']}")
    b.axhline(model.b_noise, color="k", ls="--", lw=1, label="fitted B_noise")
    b.set_xlabel("samples trained")
    b.set_ylabel("B_simple (running average)")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="cosmoflow")
    p.add_argument("--data", required=True)
    p.add_argument("--batches", default="8,16,32,64")
    p.add_argument("--fit-on", default="8,64")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--target", type=float, required=True)
    p.add_argument("--goal", choices=("min", "max"), default="min")
    p.add_argument("--lr", type=float, required=True, help="learning rate at --lr-batch")
    p.add_argument("--lr-batch", type=int, required=True)
    p.add_argument("--max-epochs", type=int, default=60)
    p.add_argument("--noise-batches", default="16,64")
    p.add_argument("--noise-ranks", type=int, default=2)
    p.add_argument("--set", nargs="*", default=[], help="further overrides (the model's size)")
    p.add_argument("--nice", type=int, default=10)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", type=Path, required=True, help="OUT.jsonl, OUT.md, OUT.png")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    fit_on = [int(b) for b in args.fit_on.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for batch in batches:
                runs.append(_train(args, batch, seed, 1, Path(tmp) / f"b{batch}_s{seed}"))
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "b_simple_trace"}), flush=True)
        for batch in [int(b) for b in args.noise_batches.split(",") if b]:
            runs.append(_train(args, batch, seeds[0], args.noise_ranks, Path(tmp) / f"noise_b{batch}"))
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "b_simple_trace"}), flush=True)
    mean_steps = {}
    for batch in batches:
        got = [r["steps_to_target"] for r in runs if r["batch"] == batch and r["ranks"] == 1]
        if any(s is None for s in got):
            raise SystemExit(f"batch {batch}: a seed did not reach {args.target} in {args.max_epochs} epochs: {got}")
        mean_steps[batch] = statistics.mean(got)
    model = fit([[b, mean_steps[b]] for b in fit_on], lr_rule=f"linear: lr {args.lr} x B / {args.lr_batch}, "
                "constant (no warmup or decay)", source=f"{args.family}, {args.data}, target {args.target}")
    simples = [r["b_simple"] for r in runs if r["b_simple"] is not None]
    model.b_simple = statistics.median(simples) if simples else None
    table = ["| global batch | steps to target, each seed | mean | predicted | error | used |",
             "| --- | --- | --- | --- | --- | --- |"]
    errors = {}
    for batch in batches:
        got = [r["steps_to_target"] for r in runs if r["batch"] == batch and r["ranks"] == 1]
        pred = model.steps(batch)
        errors[batch] = pred / mean_steps[batch] - 1
        table.append(f"| {batch} | {', '.join(str(int(g)) for g in got)} | {mean_steps[batch]:.0f} | {pred:.0f} | "
                     f"{errors[batch]:+.1%} | {'fit' if batch in fit_on else 'held out'} |")
    noise_lines = [f"| {r['batch']} | {r['ranks']} | {r['b_simple']:.3g} | {r['b_simple_run_mean']:.3g} |"
                   for r in runs if r["b_simple"] is not None]
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".jsonl"), "w", encoding="utf-8") as f:
        for r in runs:
            f.write(json.dumps(r) + "\n")
        f.write(json.dumps({"kind": "fit", **model.to_json(), "errors": {str(k): v for k, v in errors.items()}}) + "\n")
    png = _plot(out.with_suffix(".png"), runs, model, fit_on, batches)
    text = [f"# Steps to the target against the global batch: {args.family}", "",
            f"Command: `python scripts/steps_to_target.py {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
            f"Fit on batches {fit_on}: S(B) = {model.s_min:.1f} (1 + {model.b_noise:.2f} / B); "
            f"learning-rate rule: {model.lr_rule}.", "", *table, "",
            f"Held-out prediction error: worst {max(abs(errors[b]) for b in batches if b not in fit_on):.1%}.", ""]
    if noise_lines:
        text += ["In-run gradient noise scale (B_simple: running average at the run's end, and the ratio of the "
                 "run's means):", "", "| global batch | data groups | B_simple | B_simple, run mean |",
                 "| --- | --- | --- | --- |", *noise_lines, "",
                 f"Fitted B_noise {model.b_noise:.2f} against the median in-run B_simple {model.b_simple:.3g}: "
                 f"a factor {max(model.b_noise, model.b_simple) / min(model.b_noise, model.b_simple):.2g}.", ""]
    if png:
        text += [f"![steps to target and B_simple]({Path(png).name})", ""]
    out.with_suffix(".md").write_text("\n".join(text), encoding="utf-8")
    print(json.dumps({"kind": "summary", "b_noise": model.b_noise, "s_min": model.s_min, "b_simple": model.b_simple,
                      "errors": errors, "written": str(out.with_suffix(".md"))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
