"""3D U-Net preparation: synthetic cases, the KiTS19 converter and check."""

from __future__ import annotations

import re
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from parallel.data import BlockDataset
from parallel.grid import Grid
from unet3d import fields, prepare, synthetic


def _read(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with h5py.File(path, "r") as f:
        return f["image"][...], f["label"][...]


def test_synthetic_cases_are_deterministic_and_anatomically_plausible(tmp_path: Path) -> None:
    args = ["synthetic", "--size", "32", "--train", "4", "--val", "2", "--quiet", "--workers", "2"]
    assert prepare.main(args + ["--out", str(tmp_path / "a"), "--seed", "1"]) == 0
    assert prepare.main(args + ["--out", str(tmp_path / "b"), "--seed", "1", "--compression", "gzip"]) == 0
    assert prepare.main(args + ["--out", str(tmp_path / "c"), "--seed", "2"]) == 0
    for p in sorted((tmp_path / "a" / "train").glob("*.h5")):
        image, label = _read(p)
        image_b, label_b = _read(tmp_path / "b" / "train" / p.name)
        np.testing.assert_array_equal(image, image_b)
        np.testing.assert_array_equal(label, label_b)
        assert not np.array_equal(label, _read(tmp_path / "c" / "train" / p.name)[1])
        assert image.shape == (1, 1, 32, 32, 32) and label.shape == (1, 32, 32, 32) and label.dtype == np.uint8
        counts = np.bincount(label.ravel(), minlength=3)
        assert counts.size == 3 and counts[1] > 200 and counts[2] > 30  # organs, and a lesion in one
        # Lesions lie inside organs: each touches organ voxels, and most are off the organ's rim.
        lab = torch.from_numpy(label[0]).long()

        def near(c: int) -> torch.Tensor:
            return torch.nn.functional.max_pool3d((lab == c).float()[None, None], 3, 1, 1)[0, 0] > 0

        lesion = lab == 2
        assert (near(0) & lesion).sum() < (near(1) & lesion).sum()
        x = fields.transform({"image": torch.from_numpy(image[0]), "label": lab})["image"][0]
        means = [x[lab == c].mean().item() for c in (1, 2)]
        body = x[(lab == 0) & (x > -1.9)].mean().item()
        assert body + 1.0 < means[0] < means[1] - 1.0  # contrast well above the noise (z units)


def test_large_cases_are_built_in_slabs(monkeypatch: pytest.MonkeyPatch) -> None:
    whole = synthetic.case(3, 0, 1, 24)
    monkeypatch.setattr(synthetic, "SLAB_VOXELS", 24 * 24 * 7)
    sliced = synthetic.case(3, 0, 1, 24)
    np.testing.assert_array_equal(whole[1], sliced[1])
    np.testing.assert_array_equal(whole[0], sliced[0])


def test_from_kits_converts_cases_of_different_shapes(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    src = tmp_path / "kits"
    src.mkdir()
    want = {}
    for i, shape in enumerate([(20, 24, 24), (16, 32, 28), (24, 16, 16)]):
        x = rng.normal(size=(1, *shape)).astype(np.float32)
        y = rng.integers(0, 3, size=(1, *shape), dtype=np.uint8)
        np.save(src / f"case_{i:05d}_x.npy", x)
        np.save(src / f"case_{i:05d}_y.npy", y)
        want[f"case_{i:05d}"] = (x, y)
    (tmp_path / "val.txt").write_text("case_00001\n")
    assert prepare.main(["from-kits", str(src), str(tmp_path / "out"), "--val-list", str(tmp_path / "val.txt"),
                         "--quiet", "--workers", "2", "--compression", "zstd", "--splits", "2"]) == 0
    assert sorted(p.name for p in (tmp_path / "out" / "val").glob("*.h5")) == ["case_00001.h5"]
    assert len(list((tmp_path / "out" / "train").glob("*.h5"))) == 2
    for case, (x, y) in want.items():
        split = "val" if case == "case_00001" else "train"
        image, label = _read(tmp_path / "out" / split / f"{case}.h5")
        np.testing.assert_array_equal(image[0], x)
        np.testing.assert_array_equal(label[0], y[0])
    # Each case is split by its own shape; converted images are not normalised again.
    grid = Grid(spatial=(2, 1, 1), world_size=2, rank=1)
    ds = BlockDataset(tmp_path / "out" / "train", grid=grid)
    assert fields.transform_for(ds.attrs) is fields.normalized_transform
    sample = fields.normalized_transform(ds[0])
    torch.testing.assert_close(sample["image"], torch.from_numpy(want["case_00000"][0][:, 10:]))
    assert prepare.main(["check", str(tmp_path / "out")]) == 0


def test_check_flags_bad_labels_and_images(tmp_path: Path, capsys) -> None:
    prepare.main(["synthetic", "--out", str(tmp_path), "--size", "16", "--train", "3", "--val", "1",
                  "--quiet", "--workers", "1"])
    with h5py.File(tmp_path / "train" / "case_00000.h5", "a") as f:
        f["label"][0, 0, 0, 0] = 7
    with h5py.File(tmp_path / "train" / "case_00001.h5", "a") as f:
        f["image"][0, 0, 1, 2, 3] = np.inf
    with h5py.File(tmp_path / "val" / "case_00000.h5", "a") as f:
        del f["label"]
        f["label"] = np.zeros((1, 16, 16, 8), np.uint8)
    capsys.readouterr()
    assert prepare.main(["check", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"BAD {tmp_path / 'train' / 'case_00000.h5'}: field 'label' has 1 values outside [0, 2]" in out
    assert f"BAD {tmp_path / 'train' / 'case_00001.h5'}: field 'image' has 1 non-finite values" in out
    assert f"BAD {tmp_path / 'val' / 'case_00000.h5'}: field 'label' has sample shape (16, 16, 8)" in out
    assert "checked 4 files: 3 bad" in out


def test_converted_cases_carry_the_foreground_boxes_of_their_labels(tmp_path: Path, capsys) -> None:
    """Six KiTS19-format cases of six shapes convert, pass check (which recomputes the boxes
    from each label), and a tampered box is named."""
    from parallel.data.foreground import foreground_boxes

    rng = np.random.default_rng(1)
    src = tmp_path / "kits"
    src.mkdir()
    shapes = [(20, 24, 24), (16, 32, 28), (24, 16, 16), (18, 20, 30), (26, 22, 18), (12, 28, 20)]
    labels = {}
    for i, shape in enumerate(shapes):
        y = np.zeros((1, *shape), np.uint8)
        y[0, 2:9, 3:11, 4:9] = 1
        y[0, 4:7, 5:8, 5:7] = 2
        y[0, -5:-1, -6:-2, -4:-1] = rng.integers(1, 3)
        np.save(src / f"case_{i:05d}_x.npy", rng.normal(size=(1, *shape)).astype(np.float32))
        np.save(src / f"case_{i:05d}_y.npy", y)
        labels[f"case_{i:05d}"] = y[0]
    out = tmp_path / "out"
    assert prepare.main(["from-kits", str(src), str(out), "--quiet", "--workers", "1", "--crop", "16"]) == 0
    for case, label in labels.items():
        with h5py.File(out / f"{case}.h5", "r") as f:
            assert tuple(f.attrs["global_shape"]) == label.shape
            np.testing.assert_array_equal(f["fg_boxes"][0], foreground_boxes(label, 3))
            assert f["image"].chunks == (1, 1, 8, 8, 8)  # chunked for 16^3 crops
    capsys.readouterr()
    assert prepare.main(["check", str(out)]) == 0
    with h5py.File(out / "case_00002.h5", "a") as f:
        boxes = f["fg_boxes"][0]
        boxes[0, 0, 1] += 1  # a box one voxel too deep: consistent, but not this label's
        f["fg_boxes"][0] = boxes
    with h5py.File(out / "case_00004.h5", "a") as f:
        boxes = f["fg_boxes"][0]
        boxes[1, 0, 5] = 99  # beyond the case
        f["fg_boxes"][0] = boxes
    capsys.readouterr()
    assert prepare.main(["check", str(out)]) == 1
    text = capsys.readouterr().out
    assert f"BAD {out / 'case_00002.h5'}: field 'fg_boxes' sample 0 does not match the label map" in text
    assert re.search(rf"BAD {re.escape(str(out / 'case_00004.h5'))}: field 'fg_boxes' sample 0: class 2 box 0: "
                     r"\[\d+, 99\) along dim W lies outside the case's 18 voxels", text), text
    assert prepare.main(["check", str(out), "--quick"]) == 1  # the bounds need no voxel read


def test_synthetic_cases_draw_their_shapes_from_a_range(tmp_path: Path) -> None:
    assert prepare.main(["synthetic", "--out", str(tmp_path), "--size-range", "20,30,24,28,16,40", "--train", "6",
                         "--val", "2", "--quiet", "--workers", "1", "--crop", "16"]) == 0
    shapes = []
    for p in sorted((tmp_path / "train").glob("*.h5")):
        with h5py.File(p, "r") as f:
            shape = tuple(int(n) for n in f.attrs["global_shape"])
            assert f["image"].shape[2:] == shape and f["label"].shape[1:] == shape
            assert (f["fg_boxes"][0, :, 0, 0] >= 0).all()  # both classes present
        assert 20 <= shape[0] <= 30 and 24 <= shape[1] <= 28 and 16 <= shape[2] <= 40
        shapes.append(shape)
    assert len(set(shapes)) == len(shapes)
    assert prepare.main(["check", str(tmp_path)]) == 0
    with pytest.raises(SystemExit):
        prepare.main(["synthetic", "--out", str(tmp_path), "--size-range", "30,20"])
