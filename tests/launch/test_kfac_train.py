"""K-FAC in the training loop (``optim.name=kfac``; a run killed with ``kill -9`` and resumed
ends with the uninterrupted run's weights and K-FAC state: ``tests/launch/test_fail_checkpoint.py``); a run stopped at one
grid continues the serial trajectory at another; the checkpoint loads with
``weights_only=True`` and its MLPerf log says the open division. And
``scripts/benchmark.py step --optim kfac`` times each kind of K-FAC step against SGD."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from bench_cli import benchmark
from train_helpers import launch, max_rel_diff, prepare, weights

# Factors every 2 steps and eigendecompositions every 4, so that a resume lands between
# updates of both; float64 factors keep the cross-grid comparison at summation rounding.
KFAC = ["optim.name=kfac", "optim.kfac.factor_interval=2", "optim.kfac.inverse_interval=4",
        "optim.kfac.damping=0.01"]
TINY = ["--config-name", "quickstart", "train.global_batch_size=4", "model.conv_filters=4",
        "model.n_conv_blocks=2", "model.dense_sizes=[16]", "model.input_shift=3.8", "model.input_scale=2.0",
        "optim.lr=0.01", "run.progress=false", "run.log_rank=-3", "run.tensorboard=false", *KFAC]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare("cosmoflow", tmp_path_factory.mktemp("cosmo16"), 16, 16, 4)



def _kfac_state(path: Path) -> dict:
    return torch.load(path, weights_only=True)["optimizer"]["kfac"]


# A K-FAC step amplifies float32 summation-order differences by up to ~max eigenvalue /
# damping in the preconditioner; over 6 steps they stay below this (SGD: 1e-4).
RTOL = 1e-3
GRID = ["model.dropout=0.0", "train.seed=5", "run.log_every=1", "train.eval_every=0", "train.eval_at_end=false",
        "data.workers=0", "optim.kfac.factor_dtype=float64", "optim.kfac.inverse_dtype=float64"]


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


@pytest.mark.slow
def test_kfac_stopped_at_one_grid_resumes_at_another(data, tmp_path):
    common = [*TINY, *GRID, f"data.dir={data}"]
    whole = tmp_path / "whole"
    launch("cosmoflow", 1, [*common, "train.max_steps=7", f"run.dir={whole}"])
    stopped = tmp_path / "stopped"  # 3 steps at 2 ranks: after a factor update, before an inverse update
    launch("cosmoflow", 2, [*common, "train.max_steps=3", "parallel.spatial=[2,1,1]", f"run.dir={stopped}"])
    assert _kfac_state(stopped / "checkpoints" / "last.pt")["steps"] == 3
    run = tmp_path / "serial"
    shutil.copytree(stopped, run)
    launch("cosmoflow", 1, [*common, "train.max_steps=7", "parallel.spatial=[1,1,1]", f"run.dir={run}",
                            "train.resume=true"])
    diff, key = max_rel_diff(weights(whole), weights(run))
    assert diff < RTOL, f"resumed serially: {key} differs by {diff:.2e} relative"
    expected, losses = _losses(whole), _losses(run)
    for step in range(4, 8):
        assert losses[step] == pytest.approx(expected[step], rel=RTOL), f"loss at step {step}"


def test_benchmark_times_each_kind_of_kfac_step_against_sgd():
    out = benchmark("step", "--optim", "kfac", "--models", "cosmoflow", "--size", "8", "--trials", "2",
                    "--cosmoflow-set", "model.n_conv_blocks=2", "model.conv_filters=4", "--kfac",
                    "factor_interval=2", "inverse_interval=4")
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    row, summary = rows[0], rows[-1]
    med = row["measured_median_s"]
    assert set(med) == {"sgd", "kfac_plain", "kfac_factor", "kfac_inverse"} and all(v > 0 for v in med.values())
    plain, factor, inverse = med["kfac_plain"], med["kfac_factor"], med["kfac_inverse"]
    assert row["kfac_average_step_s"] == pytest.approx(plain + (factor - plain) / 2 + (inverse - factor) / 4)
    assert row["kfac_over_sgd"] == pytest.approx(row["kfac_average_step_s"] / med["sgd"])
    assert row["layers_preconditioned"] == 5 and row["predicted_kfac_s"] > 0
    assert row["predicted_kfac_over_sgd"] > 1 and summary["cosmoflow_kfac_over_sgd"] == row["kfac_over_sgd"]
