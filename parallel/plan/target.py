"""Time to the target, not time per step: the steps a global batch needs, and the ranking of
(split, global batch) by predicted steps x predicted step time.

McCandlish et al. ("An Empirical Model of Large-Batch Training", arXiv 1812.06162): the
steps to a quality target at global batch B follow ``S(B) = S_min (1 + B_noise / B)`` and
the samples ``E(B) = E_min (1 + B / B_noise)`` with ``E_min = S_min B_noise``. Below
``B_noise`` a larger batch cuts the steps almost in proportion; above it, hardly at all.
Adding ranks by data parallelism grows the batch; a spatial split adds ranks at the same
batch (Oyama et al., arXiv 2007.12856), so past ``B_noise`` it is the split that still
shortens the time to the target.

The fit (``StepsModel``) comes from what runs measured: steps to the target at two or more
global batches (least squares on ``S = S_min + S_min B_noise / B``, each point weighted by
its own size), or the steps at one batch with the in-run noise scale ``B_simple`` taken for
``B_noise`` (McCandlish report the two within a small factor of each other). It holds for
the learning-rate rule those runs used (``lr_rule``): a batch trained with another rule
needs its own runs. It is stored as JSON beside the calibration (``default_path``:
``runs/target.json`` next to ``runs/calibration.json``), written by
``python -m parallel.plan.target``, and read by ``python -m parallel.plan --target``.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from parallel.plan.machine import default_calibration

LINEAR_RULE = ("learning rate scaled linearly with the global batch (optim.lr x B / optim.lr_scale_batch, "
               "the MLPerf CosmoFlow rule), the warmup and decay epochs held")


def default_path() -> Path:
    """``target.json`` beside the calibration (``$SPATIALCNN_CALIBRATION`` or ``runs/calibration.json``)."""
    return default_calibration().with_name("target.json")


@dataclass
class StepsModel:
    """``S(B) = s_min (1 + b_noise / B)``: optimiser steps to the target at global batch B."""

    s_min: float
    b_noise: float
    points: list[list[float]] = field(default_factory=list)
    """The measured ``[batch, steps]`` the fit came from."""
    b_simple: float | None = None
    """The in-run noise scale measured beside (``summary.json``'s ``noise_scale.b_simple``)."""
    lr_rule: str = LINEAR_RULE
    """The learning-rate rule the measured runs followed across batches."""
    source: str = ""
    """What was measured: family, sample size, target, runs."""

    def steps(self, batch: float) -> float:
        return self.s_min * (1.0 + self.b_noise / batch)

    def samples(self, batch: float) -> float:
        return self.steps(batch) * batch

    def errors(self, points: Sequence[Sequence[float]] | None = None) -> list[float]:
        """Relative error of the prediction at each ``[batch, steps]``: predicted / measured - 1."""
        return [self.steps(b) / s - 1.0 for b, s in (self.points if points is None else points)]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: Path | None = None) -> Path:
        path = default_path() if path is None else Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: Path | str | None = None) -> "StepsModel":
        path = default_path() if path is None else Path(path)
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise OSError(f"{path}: no time-to-target fit (write one with python -m parallel.plan.target)") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not JSON ({err})") from None
        missing = [k for k in ("s_min", "b_noise") if k not in raw]
        if missing:
            raise ValueError(f"{path}: a time-to-target fit needs {missing} (keys: {sorted(raw)})")
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        model = cls(**known)
        if not (model.s_min > 0 and model.b_noise > 0):
            raise ValueError(f"{path}: s_min {model.s_min} and b_noise {model.b_noise} must be positive")
        return model


def fit(points: Sequence[Sequence[float]], **meta: Any) -> StepsModel:
    """``S_min`` and ``B_noise`` from ``[batch, steps]`` at two or more batches: least squares
    on ``S = a + c / B`` (``a = S_min``, ``c = S_min B_noise``), each residual over its own
    ``S`` (relative errors count alike at every batch)."""
    pts = [(float(b), float(s)) for b, s in points]
    if len({b for b, _ in pts}) < 2:
        raise ValueError(f"fitting S(B) = S_min (1 + B_noise / B) needs steps at two or more batches, got {pts}")
    if any(b <= 0 or s <= 0 for b, s in pts):
        raise ValueError(f"batches and steps must be positive, got {pts}")
    # weighted normal equations of [1, 1/B] . [a, c] = S with weights 1/S^2
    sw = sx = sxx = sy = sxy = 0.0
    for b, s in pts:
        w, x = 1.0 / s**2, 1.0 / b
        sw, sx, sxx, sy, sxy = sw + w, sx + w * x, sxx + w * x * x, sy + w * s, sxy + w * x * s
    det = sw * sxx - sx * sx
    a = (sxx * sy - sx * sxy) / det
    c = (sw * sxy - sx * sy) / det
    if a <= 0 or c <= 0:
        raise ValueError(f"the steps {pts} do not fall with the batch as S_min (1 + B_noise / B) does "
                         f"(fit: S_min {a:.4g}, S_min B_noise {c:.4g}); measure more seeds or batches")
    return StepsModel(s_min=a, b_noise=c / a, points=[list(p) for p in pts], **meta)


def from_noise_scale(batch: float, steps: float, b_simple: float, **meta: Any) -> StepsModel:
    """The model from one run: its steps to the target at ``batch`` and its measured
    ``B_simple`` taken for ``B_noise`` (an assumption: McCandlish find them within a small factor)."""
    if not (batch > 0 and steps > 0 and b_simple > 0):
        raise ValueError(f"batch {batch}, steps {steps} and B_simple {b_simple} must be positive")
    return StepsModel(s_min=steps / (1.0 + b_simple / batch), b_noise=b_simple, points=[[batch, steps]],
                      b_simple=b_simple, **meta)


def rank(rows: list[dict[str, Any]], model: StepsModel) -> list[dict[str, Any]]:
    """Each row (``data``, ``spatial``, ``global_batch``, ``step_s``, ``fits``) with its
    predicted ``steps`` and ``time_to_target_s``, fastest to the target first; ``best`` (the
    fastest that fits), ``best_data_only`` (the same among splits without a spatial split)
    marked."""
    for r in rows:
        r["steps"] = model.steps(r["global_batch"])
        r["time_to_target_s"] = r["steps"] * r["step_s"]
        r["best"] = r["best_data_only"] = False
    rows.sort(key=lambda r: r["time_to_target_s"])
    fitting = [r for r in rows if r["fits"]]
    if fitting:
        fitting[0]["best"] = True
    plain = [r for r in fitting if math.prod(r["spatial"]) == 1]
    if plain:
        plain[0]["best_data_only"] = True
    return rows


def _summary_point(run: Path) -> tuple[float, float, float | None, str]:
    """(global batch, steps to the target, B_simple or None, family) of a finished run's
    ``summary.json`` and ``config.yaml``: the first evaluation that reached the target."""
    summary_path, config_path = run / "summary.json", run / "config.yaml"
    try:
        s = json.loads(summary_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise OSError(f"{summary_path}: not found (a finished training run's directory?)") from None
    import yaml  # only for reading a run's config

    cfg = yaml.safe_load(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    batch = float((cfg.get("train") or {}).get("global_batch_size", 0))
    if not batch:
        raise ValueError(f"{config_path}: no train.global_batch_size")
    steps = _steps_to_target(run / "metrics.jsonl", s)
    if steps is None:
        raise ValueError(f"{run}: the run did not reach its target {s.get('target')} (status {s.get('status')}, "
                         f"best {s.get('best_metric')})")
    noise = s.get("noise_scale") or {}
    return batch, steps, noise.get("b_simple"), str(s.get("metric", ""))


def _steps_to_target(metrics: Path, summary: dict[str, Any]) -> float | None:
    """The step of the first evaluation whose metric reached the summary's target."""
    target, key = summary.get("target"), summary.get("metric")
    if target is None or not metrics.is_file():
        return None
    goal_min = _goal(str(key)) == "min"
    for line in metrics.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if row.get("kind") != "eval" or key not in row:
            continue
        v = float(row[key])
        if (v <= target) if goal_min else (v >= target):
            return float(row["step"])
    return None


def _goal(metric: str) -> str:
    """``min`` or ``max``: the goal of the family whose validation metric is ``metric``
    (``val_<metric_name>``); a loss or error is minimised where no family names it."""
    from parallel.job.family import get, names

    for name in names():
        family = get(name)
        if metric == f"val_{family.metric_name}":
            return str(family.goal)
    return "min" if any(w in metric for w in ("loss", "mae", "error")) else "max"


def main(argv: list[str] | None = None) -> int:
    """``python -m parallel.plan.target``: fit S(B) from finished runs (or ``--point B:STEPS``)
    and store it beside the calibration."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m parallel.plan.target", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", type=Path, help="run.dir of finished training runs at two or more batches "
                   "(or one, with its measured B_simple)")
    p.add_argument("--point", nargs="*", default=[], metavar="B:STEPS", help="measured steps to the target at a batch")
    p.add_argument("--b-simple", type=float, default=None, help="B_simple to use with a single batch")
    p.add_argument("--lr-rule", default=LINEAR_RULE, help="the learning-rate rule the runs followed")
    p.add_argument("--source", default="", help="what was measured (family, size, target)")
    p.add_argument("--out", type=Path, default=None, help=f"where to write (default {default_path()})")
    args = p.parse_args(argv)
    points: list[tuple[float, float]] = []
    simples: list[float] = []
    try:
        for text in args.point:
            b, _, s = text.partition(":")
            points.append((float(b), float(s)))
        for run in args.runs:
            b, s, simple, _ = _summary_point(run)
            points.append((b, s))
            if simple is not None:
                simples.append(simple)
        b_simple = args.b_simple if args.b_simple is not None else (
            math.exp(sum(map(math.log, simples)) / len(simples)) if simples and all(v > 0 for v in simples) else None)
        meta = {"lr_rule": args.lr_rule, "source": args.source or ", ".join(map(str, args.runs))}
        if len({b for b, _ in points}) >= 2:
            model = fit(points, **meta)
            model.b_simple = b_simple
        elif points and b_simple is not None:
            model = from_noise_scale(points[0][0], points[0][1], b_simple, **meta)
        else:
            raise ValueError(f"steps at two or more batches, or one batch and B_simple, are needed; got {points}, "
                             f"B_simple {b_simple}")
    except (OSError, ValueError) as err:
        print(f"parallel.plan.target: {err}", file=sys.stderr)
        return 2
    path = model.save(args.out)
    print(json.dumps({**model.to_json(), "errors": model.errors(), "written": str(path)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
