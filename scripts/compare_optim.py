"""Does K-FAC pay, and does bf16 train like fp32? Variants of the CosmoFlow and U-Net quickstarts.

Each run is the family's quickstart (``--config-name quickstart``, 2 ranks under mpirun,
each sample split in depth, as ``scripts/quickstart.sh`` runs it) with one seed and one
variant, stopped at the quality target. ``sgd`` runs the quickstart's own settings (fp32);
``kfac`` runs them with ``optim.name=kfac`` and the settings ``sweep`` chose; ``bf16`` runs
them with ``train.precision=bf16``. Runs of the chosen variants alternate (seed by seed, the
order flipped each seed), and the load average is recorded before and after each, so that
other work on the machine hits them alike.

    python scripts/compare_optim.py sweep --model cosmoflow   # tune K-FAC: seed 0, short runs
    python scripts/compare_optim.py run --seeds 0 1 2         # SGD against K-FAC (both models)
    python scripts/compare_optim.py report                    # table + docs/kfac_compare.png
    python scripts/compare_optim.py --out runs/compare_bf16 run --variants sgd bf16
    python scripts/compare_optim.py --out runs/compare_bf16 report --png docs/bf16_compare.png

Results go to ``runs/compare_optim/`` (``results.jsonl``: one line per run with its evaluation
curve; ``sweep.jsonl``); ``report`` prints a Markdown table of epochs and seconds to the
target and draws the validation metric against epochs and against time (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "runs" / "compare_optim"
BIN = Path(sys.executable).parent

# How scripts/quickstart.sh generates each family's synthetic set.
DATA = {"cosmoflow": ["--size", "32", "--train", "2048", "--val", "128", "--samples-per-file", "16"],
        "unet3d": ["--size-range", "32,48", "--crop", "32", "--train", "64", "--val", "16"]}
TARGET = {"cosmoflow": ("val_mae", "min", 0.124), "unet3d": ("val_mean_dice", "max", 0.908)}

# The K-FAC settings the sweep chose (docs/kfac.md#does-it-pay); SGD is the quickstart as it is.
KFAC = {
    "cosmoflow": ["optim.name=kfac", "optim.lr=0.04", "optim.kfac.damping=1.0", "optim.kfac.factor_interval=10",
                  "optim.kfac.inverse_interval=100"],
    "unet3d": ["optim.name=kfac", "optim.lr=0.1", "optim.kfac.damping=0.1", "optim.kfac.factor_interval=2",
               "optim.kfac.inverse_interval=10"],
}
# The cheaper factor updates (docs/kfac.md#cheaper-factor-updates): A from the output positions
# at even global coordinates (1/8 of them), its Gram products in bfloat16.
CHEAP = ["optim.kfac.position_stride=2", "optim.kfac.gram_dtype=bfloat16"]
# ... and the interval between factor updates lengthened while the factors change by less than
# 10% per update (up to the eigendecompositions', every 20 steps).
LEAN = CHEAP + ["optim.kfac.inverse_interval=20", "optim.kfac.stale_tol=0.1"]


def _with(base: list[str], extra: list[str]) -> list[str]:
    """``base`` with the overrides of ``extra`` (a key set in both takes ``extra``'s value)."""
    keys = {o.split("=", 1)[0] for o in extra}
    return [o for o in base if o.split("=", 1)[0] not in keys] + extra


VARIANTS = {model: {"sgd": [], "kfac": KFAC[model], "kfac_cheap": _with(KFAC[model], CHEAP),
                    "kfac_lean": _with(KFAC[model], LEAN), "bf16": ["train.precision=bf16"]} for model in KFAC}

# The sweep: damping, intervals and learning rate from the usual K-FAC values (damping
# 1e-3, factors every 10 steps, inverses every 100) towards what the first results asked
# for (more damping); on seed 0, each candidate for the first ``SWEEP_EPOCHS`` epochs; the
# pick is the best validation metric at their end. The U-Net quickstart has 16 steps an
# epoch, so its candidates update the eigenbases every 20 steps or more often.
SWEEP_EPOCHS = {"cosmoflow": 1, "unet3d": 6}
SWEEP = {
    "cosmoflow": [[f"optim.lr={lr}", f"optim.kfac.damping={d}", f"optim.kfac.factor_interval={fi}",
                   f"optim.kfac.inverse_interval={ii}"]
                  for lr, d, fi, ii in [(0.02, 1e-3, 10, 100), (0.02, 1e-2, 10, 100), (0.02, 1e-1, 10, 100),
                                        (0.02, 1.0, 10, 100), (0.02, 1e-1, 5, 20), (0.04, 1e-1, 10, 100),
                                        (0.04, 1.0, 10, 100), (0.02, 3.0, 10, 100), (0.04, 1.0, 20, 100)]],
    "unet3d": [[f"optim.lr={lr}", f"optim.kfac.damping={d}", f"optim.kfac.factor_interval={fi}",
                f"optim.kfac.inverse_interval={ii}"]
               for lr, d, fi, ii in [(0.1, 1e-2, 5, 20), (0.1, 1e-1, 5, 20), (0.1, 1.0, 5, 20),
                                     (0.2, 1.0, 5, 20), (0.1, 1e-1, 2, 10)]],
}


# The same question for SGD: does a higher learning rate alone explain a K-FAC gain?
SWEEP_SGD = {"cosmoflow": [["optim.lr=0.04"]], "unet3d": [["optim.lr=0.2"]]}


def load() -> list[float]:
    """The 1, 5 and 15 minute load averages (``uptime``)."""
    return [round(v, 2) for v in os.getloadavg()]


def ensure_data(model: str) -> Path:
    data = REPO / "data" / f"{model}_quick"
    if not (data / "val" / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", f"{model}.prepare", "synthetic", "--out", str(data), *DATA[model],
                        "--seed", "0", "--quiet"], cwd=REPO, check=True, env=_env())
    return data


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PATH"] = str(BIN) + os.pathsep + env.get("PATH", "")
    return env


def curve(run_dir: Path, metric: str) -> list[tuple[float, float, float]]:
    """(epoch, run seconds, metric) of every evaluation of a run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["epoch"], r["elapsed_s"], r[metric]) for r in rows if r["kind"] == "eval"]


def throughput(run_dir: Path) -> float | None:
    """Median training samples/s over a run's log windows (evaluations excluded)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rates = [r["samples_per_s"] for r in rows if r["kind"] == "train"]
    return statistics.median(rates) if rates else None


def first_reach(points: list[tuple[float, float, float]], goal: str, target: float) -> tuple[float, float] | None:
    """(epochs, seconds) of the first evaluation at the target, or None."""
    for epoch, secs, value in points:
        if (value <= target) if goal == "min" else (value >= target):
            return epoch, secs
    return None


def crossing(points: list[tuple[float, float, float]], target: float) -> float | None:
    """Epochs at which the straight line between the last evaluation short of the target and
    the first at it crosses the target (an estimate finer than the evaluation cadence)."""
    prev = (0.0, None)
    for epoch, _, value in points:
        hit = value <= target if points[0][2] > target else value >= target
        if hit:
            if prev[1] is None:
                return epoch
            return prev[0] + (epoch - prev[0]) * (prev[1] - target) / (prev[1] - value)
        prev = (epoch, value)
    return None


def run_one(model: str, variant: str, seed: int, overrides: list[str], run_dir: Path, nproc: int,
            timeout: float) -> dict[str, Any]:
    """One quickstart run; its row for ``results.jsonl``."""
    data = ensure_data(model)
    shutil.rmtree(run_dir, ignore_errors=True)
    args = ["-m", f"{model}.train", "--config-name", "quickstart", f"data.dir={data}", f"run.dir={run_dir}",
            f"parallel.spatial=[{nproc},1,1]", f"train.seed={seed}", "run.progress=false",
            "run.tensorboard=false", *overrides]
    cmd = [sys.executable, *args] if nproc == 1 else [str(BIN / "mpirun"), "-n", str(nproc), sys.executable, *args]
    before = load()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {"model": model, "variant": variant, "seed": seed, "overrides": overrides,
                           "command": " ".join(cmd[cmd.index("-m"):]), "load_before": before, "load_after": load(),
                           "wall_s": wall, "returncode": proc.returncode}
    if proc.returncode != 0:
        row["error"] = proc.stderr[-2000:]
        return row
    metric, goal, target = TARGET[model]
    summary = json.loads((run_dir / "summary.json").read_text())
    points = curve(run_dir, metric)
    reach = first_reach(points, goal, target)
    row.update(status=summary["status"], best=summary["best_metric"], steps=summary["steps"],
               run_seconds=summary["run_seconds"], curve=points,
               peak_memory_bytes=max(summary.get("peak_memory_bytes_per_rank") or [0]),
               epochs_to_target=reach[0] if reach else None, seconds_to_target=reach[1] if reach else None)
    return row


def append(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    shown = {k: row.get(k) for k in ("model", "variant", "seed", "status", "epochs_to_target", "seconds_to_target",
                                     "best", "wall_s", "load_before", "returncode")}
    print(json.dumps(shown), flush=True)


def sweep(args: argparse.Namespace) -> None:
    """K-FAC candidates on seed 0, each stopped at the target or ``--epochs``."""
    name = "sgd" if args.sgd else "kfac"
    for i, extra in enumerate((SWEEP_SGD if args.sgd else SWEEP)[args.model]):
        if args.only and i not in args.only:
            continue
        epochs = args.epochs or SWEEP_EPOCHS[args.model]
        over = [f"optim.name={name}", *extra, f"train.epochs={epochs}", "train.stop_at_target=false"]
        row = run_one(args.model, f"{name}-{i}", 0, over, args.out / "sweep" / f"{args.model}-{name}-{i}",
                      args.nproc, args.timeout)
        append(args.out / "sweep.jsonl", row)


def run(args: argparse.Namespace) -> None:
    """Every (seed, model, variant), the variants' order flipped each seed."""
    for k, seed in enumerate(args.seeds):
        for model in args.models:
            names = list(args.variants) if k % 2 == 0 else list(reversed(args.variants))
            for variant in names:
                row = run_one(model, variant, seed, VARIANTS[model][variant] + list(args.set),
                              args.out / "runs" / f"{model}-{variant}-{seed}", args.nproc, args.timeout)
                append(args.out / "results.jsonl", row)


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3g}" if xs else "-"


def report(args: argparse.Namespace) -> None:
    """Markdown table of epochs and seconds to the target; the plot."""
    results = args.out / "results.jsonl"
    rows = [json.loads(l) for l in results.read_text().splitlines() if l.strip()] if results.is_file() else []
    rows = [r for r in rows if r.get("returncode") == 0]
    print("| model | variant | seeds reaching target | epochs to target (median; each) | interpolated | metric at "
          "the first evaluation | seconds to target (median; each) | train samples/s (median) | peak memory per "
          "rank, MiB (median) | load avg (1 min) before-after |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for model in TARGET:
        for variant in VARIANTS[model]:
            mine = sorted((r for r in rows if r["model"] == model and r["variant"] == variant),
                          key=lambda r: r["seed"])
            if not mine:
                continue
            hit = [r for r in mine if r["epochs_to_target"] is not None]
            ep = [r["epochs_to_target"] for r in hit]
            sec = [r["seconds_to_target"] for r in hit]
            loads = [f"{r['load_before'][0]:.1f}-{r['load_after'][0]:.1f}" for r in mine]
            est = [c for c in (crossing(r["curve"], TARGET[model][2]) for r in hit) if c is not None]
            first = [r["curve"][0][2] for r in mine if r["curve"]]
            rates = [t for t in (throughput(args.out / "runs" / f"{model}-{variant}-{r['seed']}") for r in mine)
                     if t is not None]
            peaks = [r["peak_memory_bytes"] / 2**20 for r in mine if r.get("peak_memory_bytes")]
            print(f"| {model} | {variant} | {len(hit)}/{len(mine)} | {_median(ep)}; "
                  f"{', '.join(f'{e:g}' for e in ep)} | {_median(est)}; {', '.join(f'{e:.2f}' for e in est)} | "
                  f"{', '.join(f'{v:.3f}' for v in first)} | "
                  f"{_median(sec)}; {', '.join(f'{s:.0f}' for s in sec)} | {_median(rates)} | {_median(peaks)} | "
                  f"{', '.join(loads)} |")
    sweep_path = args.out / "sweep.jsonl"
    if sweep_path.is_file():
        print("\n| model | candidate | settings | validation metric at the last epoch | epochs to target |")
        print("| --- | --- | --- | --- | --- |")
        for line in sweep_path.read_text().splitlines():
            r = json.loads(line)
            if r.get("returncode") != 0:
                continue
            settings = " ".join(f"{o.split('=')[0].split('.')[-1]}={o.split('=', 1)[1]}" for o in r["overrides"]
                                if not o.startswith(("train.", "optim.name")))
            reached = r["epochs_to_target"] if r["epochs_to_target"] is not None else "-"
            print(f"| {r['model']} | {r['variant']} | {settings} | {r['curve'][-1][2]:.3f} | {reached} |")
    if args.png and rows:
        draw(rows, args.png)
        print(f"plot: {args.png}")


def draw(rows: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in TARGET if any(r["model"] == m for r in rows)]
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.6 * len(models)), squeeze=False)
    colour = {"sgd": "tab:blue", "kfac": "tab:red", "kfac_cheap": "tab:orange", "kfac_lean": "tab:purple", "bf16": "tab:green"}
    for i, model in enumerate(models):
        metric, _, target = TARGET[model]
        for j, (col, label) in enumerate([(0, "epochs"), (1, "seconds since run start (loaded 2-core machine)")]):
            ax = axes[i][j]
            seen = set()
            for r in (r for r in rows if r["model"] == model):
                xs = [p[col] for p in r["curve"]]
                ys = [p[2] for p in r["curve"]]
                name = r["variant"] if r["variant"] not in seen else None
                seen.add(r["variant"])
                ax.plot(xs, ys, "o-", ms=3, lw=1, alpha=0.8, color=colour.get(r["variant"], "grey"), label=name)
            ax.axhline(target, ls="--", color="k", lw=0.8, label=f"target {target}")
            ax.set_xlabel(label)
            ax.set_ylabel(f"validation {metric[4:].replace('_', ' ')}")
            ax.set_title(f"{model} quickstart")
            ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=OUT, help="results directory (default %(default)s)")
    p.add_argument("--nproc", type=int, default=2, help="ranks per run, splitting each sample in depth")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sweep", help=sweep.__doc__)
    s.add_argument("--model", choices=list(TARGET), required=True)
    s.add_argument("--epochs", type=int, default=None, help="epochs per candidate (default: SWEEP_EPOCHS)")
    s.add_argument("--only", nargs="*", type=int, default=[], help="run only these candidates (indices)")
    s.add_argument("--sgd", action="store_true", help="SGD's candidates (SWEEP_SGD) instead of K-FAC's")
    r = sub.add_parser("run", help=run.__doc__)
    r.add_argument("--models", nargs="+", default=list(TARGET), choices=list(TARGET))
    r.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    r.add_argument("--variants", nargs="+", default=["sgd", "kfac"], choices=list(VARIANTS["cosmoflow"]),
                   help="which variants to alternate (default: %(default)s; sgd is the fp32 quickstart)")
    r.add_argument("--set", nargs="*", default=[], help="Hydra overrides for every run")
    g = sub.add_parser("report", help=report.__doc__)
    g.add_argument("--png", type=Path, default=REPO / "docs" / "kfac_compare.png")
    args = p.parse_args(argv)
    {"sweep": sweep, "run": run, "report": report}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
