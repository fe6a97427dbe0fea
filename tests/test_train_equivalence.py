"""Whole training runs at different grids end with the same weights.

With dropout off and a fixed seed, 4 optimiser steps at ``parallel.spatial=[1,1,1]``
(one process), ``[2,1,1]`` (2 processes) and ``[2,2,1]`` (4 processes) give ``last.pt``
weights equal within 1e-4 relative, and data 2 x spatial 2 equals data 4 x spatial 1, for
CosmoFlow (the 3D U-Net's twin, on cases of six shapes with
crops and augmentation, is ``tests/test_train_cases.py``). Real processes (the session's
job pool: ``tests/jobpool.py``; the launchers themselves are ``tests/test_launchers.py``'s),
real files.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from train_helpers import launch, max_rel_diff, prepare, weights

# float32 sums in another order (halo splits, partial products, all-reduces) over 4 SGD
# steps: agreement to ~1e-5 relative; 1e-4 is the contract.
RTOL = 1e-4

MODELS = {
    "cosmoflow": dict(size=16, overrides=[
        "model.conv_filters=4", "model.n_conv_blocks=2", "model.dense_sizes=[16]", "model.dropout=0.0",
        "model.input_shift=3.8", "model.input_scale=2.0", "optim.lr=0.05"]),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def runs(request, tmp_path_factory):
    model = request.param
    spec = MODELS[model]
    data = prepare(model, tmp_path_factory.mktemp(f"{model}_data"), spec["size"], 16, 4)
    root = tmp_path_factory.mktemp(f"{model}_runs")
    common = ["--config-name", "quickstart", f"data.dir={data}", "train.global_batch_size=4",
              "train.max_steps=4", "train.seed=3", "train.eval_at_end=false", "train.eval_every=0",
              "run.progress=false", "run.tensorboard=false", "run.log_rank=-3", *spec["overrides"]]

    def run(name: str, nproc: int, spatial: str) -> Path:
        out = root / name
        launch(model, nproc, [*common, f"parallel.spatial={spatial}", f"run.dir={out}"])
        return out

    return model, run


def test_spatial_splits_equal_serial(runs):
    model, run = runs
    serial = weights(run("serial", 1, "[1,1,1]"))
    for name, nproc, spatial in [("d2", 2, "[2,1,1]"), ("d2h2", 4, "[2,2,1]")]:
        diff, key = max_rel_diff(serial, weights(run(name, nproc, spatial)))
        assert diff < RTOL, f"{model} spatial {spatial}: {key} differs by {diff:.2e} relative"


def test_data_and_spatial_axes_interchange(runs):
    model, run = runs
    data4 = weights(run("data4", 4, "[1,1,1]"))
    data2_spatial2 = weights(run("data2_spatial2", 4, "[2,1,1]"))
    diff, key = max_rel_diff(data4, data2_spatial2)
    assert diff < RTOL, f"{model}: data 4 x spatial 1 vs data 2 x spatial 2: {key} differs by {diff:.2e}"
