"""CosmoFlow preparation in one process: synthetic universes, the three converters,
resume and check. (A 16 MiB record with a flipped byte, and generation under mpirun:
tests/launch/test_prepare_cosmoflow_launch.py.)"""

import gzip
import json
from pathlib import Path

import h5py
import hdf5plugin
import numpy as np
import pytest

from cosmoflow import prepare, synthetic
from cosmoflow.fields import SPEC
from cosmoflow.tfrecord import TFRecordError, crc32c, parse_example, read_records
from parallel.data import BlockDataset, check_files
from tfrecords import example, tf_record


def _read(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with h5py.File(path, "r") as f:
        return f["volume"][...], f["target"][...]


def _summary(capsys: pytest.CaptureFixture[str]) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_synthetic_cli_is_deterministic_resumable_and_checks_clean(tmp_path: Path, capsys) -> None:
    args = ["synthetic", "--size", "16", "--train", "5", "--val", "2", "--seed", "3", "--quiet", "--workers", "2"]
    assert prepare.main(args + ["--out", str(tmp_path / "a")]) == 0
    assert prepare.main(args + ["--out", str(tmp_path / "b"), "--compression", "blosc2"]) == 0
    other_seed = [("4" if a == "3" else a) for a in args]
    assert prepare.main(other_seed + ["--out", str(tmp_path / "c")]) == 0
    files = sorted((tmp_path / "a" / "train").glob("*.h5"))
    assert len(files) == 5 and len(list((tmp_path / "a" / "val").glob("*.h5"))) == 2
    for p in files:
        va, ta = _read(p)
        vb, tb = _read(tmp_path / "b" / "train" / p.name)
        np.testing.assert_array_equal(va, vb)  # same seed, other codec: same data
        np.testing.assert_array_equal(ta, tb)
        assert va.shape == (1, 4, 16, 16, 16) and va.dtype == np.int16 and va.min() >= 0
        assert np.all(np.abs(ta) <= 1)
        assert not np.array_equal(va, _read(tmp_path / "c" / "train" / p.name)[0])
    with h5py.File(tmp_path / "b" / "train" / files[0].name, "r") as f:
        plist = f["volume"].id.get_create_plist()
        filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
        assert f.attrs["codec"] == "blosc2" and filters == [hdf5plugin.BLOSC2_ID]
    capsys.readouterr()
    files[1].unlink()
    prepare.main(args + ["--out", str(tmp_path / "a")])
    assert _summary(capsys)[0] == {"out": str(tmp_path / "a" / "train"), "written": 1, "skipped": 4,
                                   "bytes": files[1].stat().st_size}
    assert prepare.main(["check", str(tmp_path / "a")]) == 0


def test_synthetic_parameters_are_recoverable_from_simple_statistics() -> None:
    """A quadratic fit on 12 summary statistics recovers the 4 parameters to MAE < 0.124
    (MLPerf's target), so each parameter leaves a strong, distinct signature."""
    n = 32
    k = np.sqrt(sum(np.meshgrid(np.fft.fftfreq(n) ** 2, np.fft.fftfreq(n) ** 2, indexing="ij"))[..., None]
                + np.fft.rfftfreq(n)[None, None, :] ** 2)
    bins = [(k > a) & (k <= b) for a, b in zip(np.linspace(0, 0.5, 9)[:-1], np.linspace(0, 0.5, 9)[1:])]

    def stats(v: np.ndarray) -> np.ndarray:
        x = np.log1p(v.astype(np.float32))
        x -= x.mean(axis=(1, 2, 3), keepdims=True)
        power = np.abs(np.fft.rfftn(x[3])) ** 2
        return np.concatenate([np.log(x.var(axis=(1, 2, 3))), [np.log(power[m].mean()) for m in bins]])

    xs, ys = zip(*[(stats(v), u) for v, u in (synthetic.sample(0, 0, i, n) for i in range(360))])
    x, y = np.array(xs), np.array(ys)
    x = (x - x[:280].mean(0)) / x[:280].std(0)
    z = np.concatenate([np.ones((len(x), 1)), x, (x[:, :, None] * x[:, None, :]).reshape(len(x), -1)], 1)
    w = np.linalg.solve(z[:280].T @ z[:280] + 1.0 * np.eye(z.shape[1]), z[:280].T @ y[:280])
    mae = np.abs(np.clip(z[280:] @ w, -1, 1) - y[280:]).mean(0)
    assert mae.mean() < 0.124, mae
    assert mae.max() < 0.25, mae  # no parameter is left unrecoverable


def test_generation_streams_large_volumes_in_slabs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slab-wise generation (as for 512^3) gives the same universe as one-slab generation."""
    whole = synthetic.sample(5, 1, 2, 24)
    monkeypatch.setattr(synthetic, "SLAB_VOXELS", 24 * 24 * 5)
    sliced = synthetic.sample(5, 1, 2, 24)
    np.testing.assert_array_equal(whole[0], sliced[0])
    np.testing.assert_array_equal(whole[1], sliced[1])


def test_from_npy_converts_the_mlperf_numpy_layout(tmp_path: Path, capsys) -> None:
    rng = np.random.default_rng(0)
    src = tmp_path / "npy"
    want = {}
    for split in ("train", "validation"):
        (src / split).mkdir(parents=True)
        names = [f"univ_{split}_{i}" for i in range(3)]
        for name in names:
            x = rng.integers(0, 300, size=(16, 16, 16, 4), dtype=np.int16)  # channels-last
            y = rng.uniform(-1, 1, 4).astype(np.float32)
            np.save(src / split / f"{name}_data.npy", x)
            np.save(src / split / f"{name}_label.npy", y)
            want[("train" if split == "train" else "val", name)] = (x, y)
        (src / split / "files_data.lst").write_text("".join(f"{n}_data.npy\n" for n in names))
    assert prepare.main(["from-npy", str(src), str(tmp_path / "out"), "--quiet", "--workers", "2",
                         "--compression", "gzip"]) == 0
    for (split, name), (x, y) in want.items():
        volume, target = _read(tmp_path / "out" / split / f"{name}.h5")
        np.testing.assert_array_equal(volume[0], np.moveaxis(x, -1, 0))
        np.testing.assert_array_equal(target[0], y)
    assert check_files(tmp_path / "out" / "train", SPEC) == []


def test_tfrecord_framing_and_example_parsing(tmp_path: Path) -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    x = np.arange(4 * 8 ** 3, dtype=np.int16).reshape(8, 8, 8, 4)
    y = np.array([0.5, -0.25, 1.0, 0.0], dtype=np.float32)
    for packed in (True, False):
        ex = parse_example(example(x, y, packed))
        assert ex["x"][0] == "bytes" and ex["x"][1][0] == x.tobytes()
        np.testing.assert_array_equal(ex["y"][1], y)
    path = tmp_path / "bad.tfrecord"
    path.write_bytes(tf_record(example(x, y))[:-100])
    with pytest.raises(TFRecordError, match=r"bad\.tfrecord: record 0: truncated"):
        list(read_records(path))
    flipped = bytearray(tf_record(example(x, y)))
    flipped[40] ^= 0xFF
    path.write_bytes(bytes(flipped))
    with pytest.raises(TFRecordError, match="data CRC mismatch"):
        list(read_records(path))


@pytest.mark.parametrize("compressed", [True, False], ids=["gzip", "plain"])
def test_from_tfrecord_converts_the_mlperf_layout(tmp_path: Path, compressed: bool) -> None:
    rng = np.random.default_rng(1)
    src = tmp_path / "tf"
    src.mkdir()
    want = {}
    for i in range(3):
        x = rng.integers(0, 500, size=(16, 16, 16, 4), dtype=np.int16)
        y = rng.uniform(-1, 1, 4).astype(np.float32)
        raw = tf_record(example(x, y))
        name = f"univ_ics_2019-03_a{i:07d}_000.tfrecord"
        (src / name).write_bytes(gzip.compress(raw) if compressed else raw)
        want[name.replace(".tfrecord", ".h5")] = (x, y)
    assert prepare.main(["from-tfrecord", str(src), str(tmp_path / "out"), "--quiet", "--workers", "1"]) == 0
    for name, (x, y) in want.items():
        volume, target = _read(tmp_path / "out" / name)
        np.testing.assert_array_equal(volume[0], np.moveaxis(x, -1, 0))
        np.testing.assert_array_equal(target[0], y)
    (src / "zz_truncated.tfrecord").write_bytes(tf_record(example(x, y))[:5000])
    with pytest.raises(TFRecordError, match="zz_truncated.tfrecord"):
        prepare.main(["from-tfrecord", str(src), str(tmp_path / "out"), "--quiet", "--workers", "1"])


def _universes(src: Path, n: int, side: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(2)
    src.mkdir(parents=True)
    out = {}
    for i in range(n):
        full = rng.integers(0, 1000, size=(side, side, side, 4), dtype=np.int16)
        par = rng.uniform(-1, 1, 4).astype(np.float32)
        with h5py.File(src / f"univ_{i}.hdf5", "w") as f:
            f["full"] = full
            f["unitPar"] = par
        out[f"univ_{i}"] = (full, par)
    return out


def test_from_universe_cuts_crops_in_benchmark_order_and_resumes(tmp_path: Path, capsys) -> None:
    boxes = _universes(tmp_path / "boxes", 2, 32)
    out = tmp_path / "crops"
    assert prepare.main(["from-universe", str(tmp_path / "boxes"), str(out), "--crop", "8",
                         "--quiet", "--workers", "2", "--splits", "2,2x2x1"]) == 0
    assert len(list(out.glob("*.h5"))) == 2 * 64  # (32 / 8)^3 crops per box, as 512 -> 64 x 128^3
    for stem, (full, par) in boxes.items():
        for i in (0, 1, 4, 17, 63):
            cd, rest = divmod(i, 16)
            ch, cw = divmod(rest, 4)  # D, then H, then W
            volume, target = _read(out / f"{stem}_{i:03d}.h5")
            crop = full[cd * 8:(cd + 1) * 8, ch * 8:(ch + 1) * 8, cw * 8:(cw + 1) * 8]
            np.testing.assert_array_equal(volume[0], np.moveaxis(crop, -1, 0))
            np.testing.assert_array_equal(target[0], par)
    capsys.readouterr()
    (out / "univ_1_017.h5").unlink()
    prepare.main(["from-universe", str(tmp_path / "boxes"), str(out), "--crop", "8", "--quiet", "--workers", "1"])
    summary = _summary(capsys)[0]
    assert summary["written"] == 1 and summary["skipped"] == 1  # one universe redone, one skipped
    assert summary["bytes"] == (out / "univ_1_017.h5").stat().st_size  # only the missing crop rewritten


def test_from_universe_whole_boxes(tmp_path: Path) -> None:
    boxes = _universes(tmp_path / "boxes", 1, 32)
    assert prepare.main(["from-universe", str(tmp_path / "boxes"), str(tmp_path / "whole"), "--crop", "0",
                         "--quiet", "--workers", "1", "--compression", "lz4"]) == 0
    volume, target = _read(tmp_path / "whole" / "univ_0.h5")
    full, par = boxes["univ_0"]
    np.testing.assert_array_equal(volume[0], np.moveaxis(full, -1, 0))
    np.testing.assert_array_equal(target[0], par)


def test_check_names_every_bad_file_with_its_reason(tmp_path: Path, capsys) -> None:
    prepare.main(["synthetic", "--out", str(tmp_path), "--size", "16", "--train", "6", "--val", "0",
                  "--quiet", "--workers", "1", "--compression", "zstd"])
    train = tmp_path / "train"
    good = train / "sample_000000.h5"
    truncated = train / "sample_000001.h5"
    truncated.write_bytes(truncated.read_bytes()[:3000])
    with h5py.File(train / "sample_000002.h5", "a") as f:
        f["target"][0, 1] = np.nan
    with h5py.File(train / "sample_000003.h5", "a") as f:
        del f["target"]
        f["target"] = np.zeros((1, 4), np.float64)
    corrupt = train / "sample_000004.h5"
    with h5py.File(corrupt, "r") as f:
        info = f["volume"].id.get_chunk_info(3)
    raw = bytearray(corrupt.read_bytes())
    raw[info.byte_offset:info.byte_offset + info.size] = b"\x07" * info.size
    corrupt.write_bytes(bytes(raw))
    with h5py.File(train / "sample_000005.h5", "a") as f:
        del f["volume"]
    capsys.readouterr()
    assert prepare.main(["check", str(tmp_path), "--workers", "2"]) == 1
    out = capsys.readouterr().out
    assert "checked 6 files: 5 bad" in out
    lines = {line.split(": ", 1)[0][4:]: line for line in out.splitlines() if line.startswith("BAD ")}
    assert str(good) not in lines
    assert "cannot open" in lines[str(truncated)]
    assert "'target' has 1 non-finite" in lines[str(train / "sample_000002.h5")]
    assert "'target' is float64, want float32" in lines[str(train / "sample_000003.h5")]
    assert "'volume' cannot be read at" in lines[str(corrupt)]
    assert "'volume' is missing" in lines[str(train / "sample_000005.h5")]


def test_many_samples_per_file_keep_the_global_numbering(tmp_path: Path) -> None:
    assert prepare.main(["synthetic", "--out", str(tmp_path), "--size", "8", "--train", "5", "--val", "0",
                         "--samples-per-file", "2", "--quiet", "--workers", "1"]) == 0
    manifest = json.loads((tmp_path / "train" / "manifest.json").read_text())
    assert [e["samples"] for e in manifest["files"]] == [2, 2, 1]
    ds = BlockDataset(tmp_path / "train")
    assert len(ds) == 5
    for i in range(5):
        np.testing.assert_array_equal(ds[i]["volume"].numpy(), synthetic.sample(0, 0, i, 8)[0])
    assert check_files(tmp_path / "train", SPEC) == []
