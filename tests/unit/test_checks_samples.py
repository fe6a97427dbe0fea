"""The sample checks (``parallel.train.checks.samples.check_data``): a bad data set stops a
job before training with a message that names the file, the field and the numbers, on
real (deliberately broken) HDF5 files."""

import os
import re
from pathlib import Path

import h5py
import numpy as np
import pytest

from cosmoflow.family import FAMILY as COSMO
from parallel.data.format import write_manifest
from parallel.data.reader import SampleReadError
from parallel.grid import Grid
from parallel.train.checks.samples import check_data
from parallel.train.data import CheckedDataset
from sample_sets import SERIAL, SIZE, fails, job_on, make_set, rewrite, sample


@pytest.fixture
def good(tmp_path):
    return make_set(tmp_path / "set")


def test_a_good_set_passes(good):
    job = job_on(good)
    assert check_data(job.data, job.model, COSMO, SERIAL).volume == (SIZE, SIZE, SIZE)


def test_missing_or_unusable_data_dir(tmp_path, good):
    fails(job_on(tmp_path / "nowhere"), r"data\.dir: .*nowhere does not exist; generate a set with "
                                        r"`python -m cosmoflow\.prepare synthetic --out .*nowhere`")
    (tmp_path / "afile").write_text("x")
    fails(job_on(tmp_path / "afile"), r"data\.dir: .*afile is not a directory")
    (good / "val" / "manifest.json").unlink()
    for p in (good / "val").iterdir():
        p.unlink()
    fails(job_on(good), r"data\.val_subdir: .*val holds no sample files")
    os.rmdir(good / "val")
    fails(job_on(good), r"has no val/ directory .*python -m cosmoflow\.prepare synthetic")


def _unreadable_case(root: str) -> None:
    """In a forked child: drop root (which reads everything) to 'nobody', then check."""
    if os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)
    fails(job_on(Path(root)), r"data\.train_subdir: .*train is not readable")


def test_unreadable_data_dir(good):
    import multiprocessing
    import shutil
    import tempfile

    # a world-traversable copy, so that an unprivileged child reaches it
    base = Path(tempfile.mkdtemp(prefix="unreadable_"))
    try:
        os.chmod(base, 0o755)
        root = base / "set"
        shutil.copytree(good, root)
        for p in [root, *root.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        os.chmod(root / "train", 0)
        child = multiprocessing.get_context("fork").Process(target=_unreadable_case, args=(str(root),))
        child.start()
        child.join(timeout=120)
        assert child.exitcode == 0, f"the unreadable train/ directory was not reported as such (exit {child.exitcode})"
    finally:
        if (base / "set" / "train").exists():
            os.chmod(base / "set" / "train", 0o755)
        shutil.rmtree(base, ignore_errors=True)


def test_truncated_and_corrupt_hdf5(good):
    truncated = good / "train" / "s001.h5"
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    corrupt = good / "val" / "s000.h5"
    corrupt.write_bytes(b"\x00garbage" * 100)
    text = fails(job_on(good), re.escape(str(truncated)) + r": cannot open as HDF5 \(corrupt or truncated\?\)",
                 re.escape(str(corrupt)) + r": cannot open as HDF5")
    assert text.startswith("2 problem(s)")


def test_missing_field(good):
    path = good / "train" / "s002.h5"
    rewrite(path, target=None)
    fails(job_on(good), re.escape(str(path)) + r": field 'target' is missing \(has \['volume'\]\)")


def test_wrong_shapes(good):
    rng = np.random.default_rng(1)
    small = good / "train" / "s000.h5"
    rewrite(small, target=rng.uniform(-1, 1, (1, 3)).astype(np.float32))
    other = good / "val" / "s001.h5"
    rewrite(other, volume=sample(rng, 4)["volume"])
    fails(job_on(good), re.escape(str(small)) + r": field 'target' has sample shape \(3,\), want \(4,\)",
          re.escape(str(other)) + r": field 'volume' has sample shape \(4, 4, 4, 4\), want \(4, 8, 8, 8\)")


def test_wrong_dtype(good):
    path = good / "train" / "s003.h5"
    rewrite(path, volume=np.zeros((1, 4, SIZE, SIZE, SIZE), np.float32))
    fails(job_on(good), re.escape(str(path)) + r": field 'volume' is float32, want int16")


def test_non_finite_targets(good):
    path = good / "val" / "s001.h5"
    target = np.array([[0.1, np.nan, 0.2, np.inf]], np.float32)
    rewrite(path, target=target)
    fails(job_on(good), re.escape(str(path)) + r": field 'target' has 2 non-finite values \(NaN or inf\), "
                        r"want all finite")


def test_manifest_that_disagrees_with_a_file(good):
    path = good / "train" / "s000.h5"
    with h5py.File(path, "r+") as f:
        f.attrs["samples"] = 1
    write_manifest(good / "train", "cosmoflow", counts={"s000.h5": 3})
    fails(job_on(good), re.escape(str(path)) + r": manifest\.json lists 3 samples, the file holds 1")
    (good / "train" / "manifest.json").write_text("{not json")
    fails(job_on(good), r"data\.train_subdir: .*manifest\.json cannot be read")


def test_deep_check_reads_voxels(good):
    path = good / "train" / "s001.h5"
    volume = np.zeros((1, 4, SIZE, SIZE, SIZE), np.int16)
    volume[0, 1, 2, 3, 4] = -5
    rewrite(path, volume=volume)
    job = job_on(good)
    assert check_data(job.data, job.model, COSMO, SERIAL)  # quick: voxels are not read
    fails(job_on(good, check="deep"), re.escape(str(path)) + r": field 'volume' has 1 values outside \[0, 32767\]")


@pytest.mark.parametrize("mode", ["fail", "skip"])
def test_non_finite_input_voxels(good, mode):
    path = good / "train" / "s002.h5"
    volume = np.zeros((1, 4, SIZE, SIZE, SIZE), np.int16)
    volume[0, 0, 5, 1, 1] = -1  # log(x + 1) of -1 is -inf
    rewrite(path, volume=volume)
    from cosmoflow.fields import transform

    ds = CheckedDataset(good / "train", fields=("volume", "target"), grid=Grid((2, 1, 1), 2, 1), transform=transform,
                        input_field="volume", target_field="target", nonfinite=mode)
    assert ds.input_finite(ds.load(1)[0]) if mode == "skip" else ds.load(1)
    if mode == "fail":
        with pytest.raises(SampleReadError, match=re.escape(str(path)) + r": field 'volume' sample 0: 1 non-finite "
                                                   r"values .* in this rank's block \[\(4, 8\), \(0, 8\), \(0, 8\)\]"):
            ds.load(2)
    else:
        assert ds.input_finite(ds.load(2)[0]) is False
        other = CheckedDataset(good / "train", fields=("volume", "target"), grid=Grid((2, 1, 1), 2, 0),
                               transform=transform, input_field="volume", target_field="target", nonfinite=mode)
        assert other.input_finite(other.load(2)[0]) is True  # the other block is fine: the loop all-reduces the flags
