"""CosmoFlow preparation as launched: an MLPerf-sized TFRecord with one flipped byte is
refused naming the file and the record, and synthetic generation under mpirun shares the
files among the ranks."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np

from cosmoflow import synthetic
from tfrecords import example, tf_record
from train_helpers import python_m


def _read(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with h5py.File(path, "r") as f:
        return f["volume"][...], f["target"][...]


def test_a_flipped_byte_in_a_16mb_record_is_refused(tmp_path: Path) -> None:
    """An MLPerf-sized record (128^3 x 4 int16 = 16 MiB) with one byte of its data flipped:
    the command refuses it, naming the file and the record, and writes nothing."""

    x = np.random.default_rng(3).integers(0, 500, size=(128, 128, 128, 4), dtype=np.int16)
    raw = bytearray(tf_record(example(x, np.zeros(4, np.float32))))
    assert len(raw) > 16 * 2**20
    raw[len(raw) // 2] ^= 0xFF  # a voxel in the middle of the record's data
    src = tmp_path / "tf"
    src.mkdir()
    bad = src / "univ_ics_2019-03_a0000000_000.tfrecord"
    bad.write_bytes(bytes(raw))
    proc = python_m("cosmoflow.prepare", ["from-tfrecord", str(src), str(tmp_path / "out"), "--quiet", "--workers", "1"],
                    timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{bad}: record 0: data CRC mismatch" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not list((tmp_path / "out").glob("*.h5"))


def test_synthetic_under_mpirun_shares_the_files(tmp_path: Path) -> None:
    assert shutil.which("mpirun"), "mpirun not found: install the 'mpi' extra (pip install -e .[mpi])"
    out = subprocess.run(["mpirun", "-n", "2", sys.executable, "-m", "cosmoflow.prepare", "synthetic",
                          "--out", str(tmp_path), "--size", "16", "--train", "5", "--val", "1", "--seed", "3",
                          "--workers", "1", "--quiet"], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    summaries = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [s["written"] for s in summaries] == [5, 1]  # totals over both ranks, printed once
    for i in range(5):
        volume, target = _read(tmp_path / "train" / f"sample_{i:06d}.h5")
        want_v, want_t = synthetic.sample(3, 0, i, 16)
        np.testing.assert_array_equal(volume[0], want_v)
        np.testing.assert_array_equal(target[0], want_t)
