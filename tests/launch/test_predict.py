"""Inference entry points: the same predictions at every grid, and what a prediction
says it read and refuses. (The sliding window's weighting:
tests/unit/test_sliding_window_logits.py.)"""

import csv
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest

from train_helpers import launch, prepare, python_m


def _run(module: str, nproc: int, args: list[str], code: int = 0) -> subprocess.CompletedProcess:
    proc = python_m(module, args, nproc=nproc, timeout=180)
    assert proc.returncode == code, f"{module} {' '.join(args)} on {nproc} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc



@pytest.fixture(scope="module")
def unet_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("unet_predict")
    data = prepare("unet3d", root / "data", 24, 4, 3)
    run = root / "run"
    launch("unet3d", 1, ["--config-name", "quickstart", f"data.dir={data}", f"run.dir={run}", "train.max_steps=2",
                         "data.crop=[16,16,16]", "train.eval_every=0", "train.eval_at_end=false",
                         "run.progress=false", "run.tensorboard=false", "mlperf.enabled=false"])
    return data, run



def _labels(out: Path) -> dict[str, np.ndarray]:
    files = sorted(out.glob("*.h5"))
    assert files, f"no label files in {out}"
    result = {}
    for f in files:
        with h5py.File(f, "r") as h:
            result[f.name] = h["label"][...]
    return result



def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray], what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        # logits agree to float rounding; an argmax can flip only at an exact near-tie
        mismatch = float((a[name] != b[name]).mean())
        assert mismatch < 1e-3, f"{what}: {name} differs in {mismatch:.2%} of voxels"



def test_unet_predict_is_the_same_at_every_grid(unet_run, tmp_path):
    data, run = unet_run
    common = ["--run-dir", str(run), "--data", str(data / "val")]
    # the run's own evaluation: sliding window of its crop, 16 (8 windows per 24^3 case)
    _run("unet3d.predict", 1, [*common, "--out", str(tmp_path / "serial")])
    _run("unet3d.predict", 2, [*common, "--out", str(tmp_path / "spatial2"), "--spatial", "2", "1", "1"])
    _run("unet3d.predict", 2, [*common, "--out", str(tmp_path / "data2")])
    serial = _labels(tmp_path / "serial")
    assert len(serial) == 3 and all(v.shape[1:] == (24, 24, 24) for v in serial.values())
    for other in ("spatial2", "data2"):
        _same(serial, _labels(tmp_path / other), other)
    # one window the size of the case is the whole-case pass
    _run("unet3d.predict", 1, [*common, "--out", str(tmp_path / "whole"), "--mode", "whole"])
    _run("unet3d.predict", 1, [*common, "--out", str(tmp_path / "w24"), "--window", "24"])
    _same(_labels(tmp_path / "whole"), _labels(tmp_path / "w24"), "window 24")
    # a window larger than the case: padded, centred, as the reference pads; split in H or not
    _run("unet3d.predict", 1, [*common, "--out", str(tmp_path / "w32"), "--window", "32"])
    _run("unet3d.predict", 2, [*common, "--out", str(tmp_path / "w32s"), "--window", "32", "--spatial", "1", "2", "1"])
    _same(_labels(tmp_path / "w32"), _labels(tmp_path / "w32s"), "window 32")



def test_unet_predict_says_what_it_read_and_refuses_user_errors_in_one_line(unet_run, tmp_path):
    data, run = unet_run
    out = ["--out", str(tmp_path / "seg")]
    proc = _run("unet3d.predict", 1, ["--run-dir", str(run), "--data", str(data), "--split", "train", *out])
    assert f"the train split of the data directory {data} ({data / 'train'})" in proc.stderr
    assert len(_labels(tmp_path / "seg")) == 4
    proc = _run("unet3d.predict", 1, ["--run-dir", str(run), "--out", str(tmp_path / "seg2")])  # the run's data.dir
    assert f"the val split of the data directory {data}" in proc.stderr
    for args, message in [
        (["--data", str(data / "val"), "--window", "20"], "--window 20 20 20: model.depth=3 needs volumes that are "
                                                          "multiples of 8 (its total stride)"),
        (["--data", str(data / "val"), "--window", "8"], "(InstanceNorm3d) normalises each channel over its 1x1x1 "
                                                         "voxel(s) at a volume of [8, 8, 8]"),
        (["--data", str(data / "nowhere")], f"--data {data / 'nowhere'}: no such directory or file"),
        (["--data", str(data.parent)], "holds no sample files (*.h5) and no val/ split"),
    ]:
        proc = _run("unet3d.predict", 1, ["--run-dir", str(run), *args, *out], code=2)
        lines = [line for line in proc.stderr.splitlines() if "error:" in line]
        assert lines == [f"python -m unet3d.predict: error: {lines[0].split('error: ', 1)[1]}"] and \
            message in lines[0] and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    # split across 2 ranks, the window 24 cuts the network's third stride at 3: refused by name, once
    proc = _run("unet3d.predict", 2, ["--run-dir", str(run), "--data", str(data / "val"), "--window", "24",
                                      "--spatial", "2", "1", "1", *out], code=2)
    assert proc.stderr.count("--window 24 24 24: split 2 ways along dim D (24 -> blocks [12, 12])") == 1, proc.stderr
    helped = _run("unet3d.predict", 1, ["--help"])
    assert "the data directory (data.dir, holding train/ and val/" in " ".join(helped.stdout.split())



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
    _run("cosmoflow.predict", 2, [*common, "--out", str(tmp_path / "data.csv")])

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
