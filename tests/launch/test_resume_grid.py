"""Resume is exact across a change of grid.

A run stopped mid-epoch at ``parallel.spatial=[2,1,1]`` (2 ranks) resumes at
``[1,1,1]`` (one process) and at ``[2,2,1]`` (4 ranks), and both continue the
uninterrupted trajectory: the same losses at every later step and the same final
weights, to the grid-equivalence tolerance. This holds because the checkpoint is the
serial model's state, the sampler's order depends only on the seed, the epoch and the
global batch (never on the grid), and with dropout off no other random stream is used.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from train_helpers import launch, max_rel_diff, prepare, weights

# float32 sums in another order over a few SGD steps (float64 runs: tests/launch/test_contract_matrix.py); SGD, since
# AdamW's normalisation amplifies that rounding (3e-4 relative after 10 AdamW steps, no resume)
RTOL = 1e-4
ARGS = ["--config-name", "quickstart", "train.global_batch_size=4", "model.conv_filters=4", "model.n_conv_blocks=2",
        "model.dense_sizes=[16]", "model.dropout=0.0", "model.input_shift=3.8", "model.input_scale=2.0",
        "optim.name=sgd", "optim.lr=0.05", "train.seed=5", "run.progress=false", "run.tensorboard=false",
        "run.log_rank=-3", "run.log_every=1", "train.eval_every=0", "train.eval_at_end=false", "data.workers=0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare("cosmoflow", tmp_path_factory.mktemp("cosmo16"), 16, 16, 4)


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def test_stop_at_one_grid_resume_at_others(data, tmp_path):
    common = [*ARGS, f"data.dir={data}"]
    whole = tmp_path / "whole"
    launch("cosmoflow", 1, [*common, "train.max_steps=6", f"run.dir={whole}"])
    stopped = tmp_path / "stopped"  # 3 steps: in the middle of the first epoch of 4 steps
    launch("cosmoflow", 2, [*common, "train.max_steps=3", "parallel.spatial=[2,1,1]", f"run.dir={stopped}"])

    expected = _losses(whole)
    for name, nproc, spatial in [("serial", 1, "[1,1,1]"), ("d2h2", 4, "[2,2,1]")]:
        run = tmp_path / name
        shutil.copytree(stopped, run)
        launch("cosmoflow", nproc, [*common, "train.max_steps=6", f"parallel.spatial={spatial}", f"run.dir={run}",
                                    "train.resume=true"])
        diff, key = max_rel_diff(weights(whole), weights(run))
        assert diff < RTOL, f"resumed at {spatial}: {key} differs by {diff:.2e} relative"
        losses = _losses(run)
        for step in range(4, 7):
            assert losses[step] == pytest.approx(expected[step], rel=RTOL), f"{spatial}: loss at step {step}"
