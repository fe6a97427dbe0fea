"""Training on cases of different shapes, end to end, as a KiTS19 user would.

Six MLPerf-preprocessed KiTS19-format cases (``case_XXXXX_x.npy`` / ``_y.npy``), each of
its own shape, convert (``unet3d.prepare from-kits``), pass ``unet3d.prepare check`` and
train with 16^3 crops and sliding-window evaluation: 4 steps with a fixed seed at
``parallel.spatial=[1,1,1]``, ``[2,1,1]``, ``[2,2,1]`` and data 2 x spatial 2 end with the
same weights (the same crops at every grid) and the same validation Dice, and every rank
read at most 1.1 x crop bytes / spatial ranks + one chunk per training sample (the loop's
own reader counters, in ``summary.json``). A crop or case the network cannot take stops
the job before training: exit 2, one message from rank 0, naming the key or file.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest

from train_helpers import env, launch, max_rel_diff, pool, weights

RTOL = 1e-4  # float32 sums in another order over 4 SGD steps (float64 runs: tests/launch/test_contract_matrix.py)
CROP = 16
TRAIN_SHAPES = [(40, 36, 44), (34, 48, 38), (46, 40, 35), (38, 44, 42)]  # all larger than the crop
VAL_SHAPES = [(12, 26, 20), (44, 29, 37)]  # one smaller than the window along D (padded)


def _kits_sources(root: Path) -> tuple[Path, Path]:
    """Six cases in the MLPerf-preprocessed layout (normalised float32 image, uint8 label)."""
    from unet3d import synthetic
    from unet3d.fields import CLIP, MEAN, STD

    src = root / "kits_npy"
    src.mkdir()
    for i, shape in enumerate(TRAIN_SHAPES + VAL_SHAPES):
        image, label = synthetic.case(7, 0, i, shape)
        x = ((np.clip(image, *CLIP) - MEAN) / STD).astype(np.float32)
        np.save(src / f"case_{i:05d}_x.npy", x)
        np.save(src / f"case_{i:05d}_y.npy", label[None].astype(np.uint8))
    val_list = root / "evaluation_cases.txt"
    val_list.write_text("case_00004\ncase_00005\n")
    return src, val_list


def _prepare(*args: str) -> subprocess.CompletedProcess:
    proc = pool().run("unet3d.prepare", args, env=env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def kits(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("kits")
    src, val_list = _kits_sources(root)
    out = root / "kits_h5"
    _prepare("from-kits", str(src), str(out), "--val-list", str(val_list), "--crop", str(CROP), "--quiet",
             "--workers", "1")
    _prepare("check", str(out), "--workers", "1")
    shapes = {}
    for split in ("train", "val"):
        for path in sorted((out / split).glob("*.h5")):
            with h5py.File(path, "r") as f:
                shapes[path.name] = tuple(int(n) for n in f.attrs["global_shape"])
    assert sorted(shapes.values()) == sorted(TRAIN_SHAPES + VAL_SHAPES)  # six shapes, each case its own
    return out


def _common(data: Path) -> list[str]:
    return ["--config-name", "quickstart", f"data.dir={data}", f"data.crop=[{CROP},{CROP},{CROP}]",
            "data.oversampling=0.5", "model.depth=2", "model.base_filters=4", "model.max_filters=8",
            "train.global_batch_size=2", "train.max_steps=4", "train.seed=3", "train.eval_every=0",
            "train.eval_at_end=true", "eval.mode=sliding", "optim.lr=0.05", "run.progress=false",
            "run.tensorboard=false", "mlperf.enabled=false",
            "augment.flip_prob=0.5", "augment.brightness_prob=0.5", "augment.noise_prob=0.5"]


def test_cases_of_six_shapes_train_alike_at_every_grid_reading_only_their_share(kits, tmp_path):
    runs = {}
    for name, nproc, spatial in [("serial", 1, "[1,1,1]"), ("d2", 2, "[2,1,1]"), ("d2h2", 4, "[2,2,1]"),
                                 ("data2_d2", 4, "[2,1,1]")]:
        runs[name] = tmp_path / name
        launch("unet3d", nproc, [*_common(kits), f"parallel.spatial={spatial}", f"run.dir={runs[name]}"],
               timeout=420)
    serial = weights(runs["serial"])
    summaries = {n: json.loads((r / "summary.json").read_text()) for n, r in runs.items()}
    for name in ("d2", "d2h2", "data2_d2"):
        diff, key = max_rel_diff(serial, weights(runs[name]))
        assert diff < RTOL, f"{name}: {key} differs by {diff:.2e} relative"
        # the same Dice up to an argmax flip of a voxel at a near-tie (weights agree to ~1e-6)
        dice = summaries[name]["best_metric"]
        assert dice == pytest.approx(summaries["serial"]["best_metric"], abs=2e-3), name
    assert 0.0 < summaries["serial"]["best_metric"] < 1.0

    with h5py.File(next((kits / "train").glob("*.h5")), "r") as f:
        chunk = math.prod(f["image"].chunks) * 4  # the largest chunk: the float32 image's
    crop_bytes = CROP ** 3 * (4 + 1)  # float32 image + uint8 label
    for name, s in summaries.items():
        spatial = math.prod(s["grid"]["spatial"])
        bound = 1.1 * crop_bytes / spatial + chunk
        for rank, per_sample in enumerate(s["bytes_read_per_rank_per_sample"]):
            assert 0 < per_sample <= bound, (name, rank, per_sample, bound)


def _refused(data: Path, run: Path, extra: list[str], nproc: int) -> str:
    proc = launch("unet3d", nproc, [*_common(data), f"run.dir={run}", *extra], timeout=300, check=False)
    assert proc.returncode == 2, f"exit {proc.returncode}:\n{proc.stderr[-4000:]}"  # every rank's own status
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert not (run / "checkpoints" / "last.pt").exists()
    return proc.stderr


def test_a_crop_or_case_the_network_cannot_take_stops_before_training(kits, tmp_path):
    # 12 = 3 x 4 fits the 2-level network, but split 2 ways its second strided conv gets 3 voxels per block
    err = _refused(kits, tmp_path / "crop", ["data.crop=[12,16,16]", "parallel.spatial=[2,1,1]"], nproc=2)
    assert err.count("data.crop=[12, 16, 16]: split 2 ways along dim D (12 -> blocks [6, 6])") == 1, err[-3000:]
    assert err.count("ERROR") == 1 and "[rank 1]" not in err, err[-3000:]  # one message, from rank 0
    assert "blocks must be multiples of the network's total stride 4 along D" in err
    # whole-volume evaluation: the validation cases (12, 26, 20) and (44, 29, 37) are no multiples of 4
    err = _refused(kits, tmp_path / "whole", ["eval.mode=whole"], nproc=1)
    assert err.count("val/case_00005.h5 [44, 29, 37] (eval.mode=whole): model.depth=2 needs volumes that are "
                     "multiples of 4") == 1, err[-3000:]
    assert "val/case_00004.h5 [12, 26, 20]" in err
