"""Inference entry points: the same predictions at every grid, and the sliding window."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from train_helpers import BIN, REPO, env, launch, prepare
from unet3d.predict import sliding_window


def _run(module: str, nproc: int, args: list[str], launcher: str = "torchrun") -> None:
    if nproc == 1:
        cmd = [sys.executable, "-m", module, *args]
    elif launcher == "torchrun":
        cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(nproc), "-m", module, *args]
    else:
        cmd = [str(BIN / "mpirun"), "-n", str(nproc), sys.executable, "-m", module, *args]
    proc = subprocess.run(cmd, env=env(), cwd=REPO, timeout=180, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-4000:]}"


@pytest.mark.unit
@pytest.mark.parametrize("shape, window", [((20, 24, 28), 16), ((20, 12, 9), 16), ((16, 16, 16), 16)])
def test_sliding_window_of_a_pointwise_model_is_the_whole_volume_softmax(shape, window):
    # A 1x1x1 conv sees no context, so every window gives each voxel the same logits: the
    # Gaussian-weighted average must reproduce the whole-volume softmax wherever it covers
    # the volume (uneven tiling, last window flush with the end, padding when it is larger).
    torch.manual_seed(0)
    model = nn.Conv3d(2, 3, 1)
    x = torch.randn(1, 2, *shape)
    with torch.no_grad():
        expect = torch.softmax(model(x), 1)
    got = sliding_window(model, x, window, classes=3)
    assert got.shape == expect.shape
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def unet_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("unet_predict")
    data = prepare("unet3d", root / "data", 16, 4, 3)
    run = root / "run"
    launch("unet3d", 1, ["--config-name", "quickstart", f"data.dir={data}", f"run.dir={run}", "train.max_steps=2",
                         "train.eval_every=0", "train.eval_at_end=false", "run.progress=false",
                         "run.tensorboard=false", "mlperf.enabled=false"])
    return data, run


def _labels(out: Path) -> dict[str, np.ndarray]:
    files = sorted(out.glob("*.h5"))
    assert files, f"no label files in {out}"
    result = {}
    for f in files:
        with h5py.File(f, "r") as h:
            result[f.name] = h["label"][...]
    return result


def test_unet_predict_is_the_same_at_every_grid(unet_run, tmp_path):
    data, run = unet_run
    common = ["--run-dir", str(run), "--data", str(data / "val")]
    _run("unet3d.predict", 1, [*common, "--out", str(tmp_path / "serial")])
    _run("unet3d.predict", 2, [*common, "--out", str(tmp_path / "spatial2"), "--spatial", "2", "1", "1"])
    _run("unet3d.predict", 2, [*common, "--out", str(tmp_path / "data2")], launcher="mpirun")
    _run("unet3d.predict", 1, [*common, "--out", str(tmp_path / "window"), "--window", "16"])
    serial = _labels(tmp_path / "serial")
    assert len(serial) == 3 and all(v.shape[1:] == (16, 16, 16) for v in serial.values())
    for other in ("spatial2", "data2", "window"):  # one window of the whole volume: the same pass
        got = _labels(tmp_path / other)
        assert got.keys() == serial.keys()
        for name in serial:
            # logits agree to float rounding; an argmax can flip only at an exact near-tie
            mismatch = float((got[name] != serial[name]).mean())
            assert mismatch < 1e-3, f"{other}: {name} differs from the serial labels in {mismatch:.2%} of voxels"


def test_cosmoflow_predict_rows_equal_at_every_grid(tmp_path_factory, tmp_path):
    root = tmp_path_factory.mktemp("cosmo_predict")
    data = prepare("cosmoflow", root / "data", 16, 8, 6)
    run = root / "run"
    launch("cosmoflow", 1, ["--config-name", "quickstart", f"data.dir={data}", f"run.dir={run}",
                            "train.global_batch_size=4", "model.conv_filters=4", "model.n_conv_blocks=2",
                            "model.dense_sizes=[16]", "train.max_steps=2", "train.eval_every=0",
                            "train.eval_at_end=false", "run.progress=false", "run.tensorboard=false",
                            "mlperf.enabled=false"])
    common = ["--run-dir", str(run), "--data", str(data / "val"), "--batch", "4"]
    _run("cosmoflow.predict", 1, [*common, "--out", str(tmp_path / "serial.csv")])
    _run("cosmoflow.predict", 2, [*common, "--out", str(tmp_path / "split.csv"), "--spatial", "2", "1", "1"])
    _run("cosmoflow.predict", 2, [*common, "--out", str(tmp_path / "data.csv")], launcher="mpirun")

    def rows(name: str) -> list[dict[str, str]]:
        with open(tmp_path / name, newline="") as f:
            return list(csv.DictReader(f))

    serial = rows("serial.csv")
    assert len(serial) == 6 and len({(r["file"], r["row"]) for r in serial}) == 6
    for name in ("split.csv", "data.csv"):
        other = rows(name)
        assert [(r["file"], r["row"]) for r in other] == [(r["file"], r["row"]) for r in serial], name
        for a, b in zip(serial, other):
            for key in a:
                if key.startswith("pred_") or key.startswith("true_"):
                    assert abs(float(a[key]) - float(b[key])) <= 2e-6, f"{name}: {key} {a[key]} != {b[key]}"
