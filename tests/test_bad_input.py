"""Bad input stops a job before training, with a message that names the culprit.

Most cases run the pre-flight checks in-process on real (deliberately broken) HDF5 files;
a few launch the real entry point to show the clean exit: one message, no traceback,
non-zero status.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from cosmoflow.family import FAMILY as COSMO, CosmoFlowJob
from cosmoflow.fields import SPEC
from cosmoflow.model import CosmoFlowConfig
from parallel.data.format import write_manifest, write_samples
from parallel.data.reader import SampleReadError
from parallel.grid import Grid
from parallel.train.cli import CONFIG_ROOT, register
from parallel.job.config import UnknownKeyError, to_dataclass
from parallel.train.data import CheckedDataset
from parallel.train.checks.config import validate_config
from parallel.train.checks.fit import check_model
from parallel.train.checks.samples import check_data
from parallel.job.errors import ConfigError, InputError
from train_helpers import BIN, REPO, env, prepare, python_m

SIZE = 8
SERIAL = Grid((1, 1, 1), 1, 0)


def _sample(rng: np.random.Generator, size: int = SIZE) -> dict[str, np.ndarray]:
    return {"volume": rng.integers(0, 50, (1, 4, size, size, size), dtype=np.int16),
            "target": rng.uniform(-1, 1, (1, 4)).astype(np.float32)}


def _make_set(root: Path, n_train: int = 4, n_val: int = 2) -> Path:
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("val", n_val)):
        (root / split).mkdir(parents=True)
        for i in range(n):
            write_samples(root / split / f"s{i:03d}.h5", SPEC, _sample(rng))
        write_manifest(root / split, "cosmoflow")
    return root


def _job(root: Path, **data: object) -> CosmoFlowJob:
    job = CosmoFlowJob()
    job.data.dir = str(root)
    for k, v in data.items():
        setattr(job.data, k, v)
    return job


def _rewrite(path: Path, **fields: np.ndarray) -> None:
    """Replace fields of a sample file in place (dropping those given as None)."""
    with h5py.File(path, "r+") as f:
        for name, value in fields.items():
            del f[name]
            if value is not None:
                f.create_dataset(name, data=value)


@pytest.fixture
def good(tmp_path):
    return _make_set(tmp_path / "set")


def _fails(job: CosmoFlowJob, *patterns: str, grid: Grid = SERIAL) -> str:
    with pytest.raises(InputError) as info:
        check_data(job.data, job.model, COSMO, grid)
    text = str(info.value)
    for p in patterns:
        assert re.search(p, text), f"{p!r} not in:\n{text}"
    return text


def test_a_good_set_passes(good):
    job = _job(good)
    assert check_data(job.data, job.model, COSMO, SERIAL).volume == (SIZE, SIZE, SIZE)


def test_missing_or_unusable_data_dir(tmp_path, good):
    _fails(_job(tmp_path / "nowhere"), r"data\.dir: .*nowhere does not exist; generate a set with "
                                        r"`python -m cosmoflow\.prepare synthetic --out .*nowhere`")
    (tmp_path / "afile").write_text("x")
    _fails(_job(tmp_path / "afile"), r"data\.dir: .*afile is not a directory")
    (good / "val" / "manifest.json").unlink()
    for p in (good / "val").iterdir():
        p.unlink()
    _fails(_job(good), r"data\.val_subdir: .*val holds no sample files")
    os.rmdir(good / "val")
    _fails(_job(good), r"has no val/ directory .*python -m cosmoflow\.prepare synthetic")


def _unreadable_case(root: str) -> None:
    """In a forked child: drop root (which reads everything) to 'nobody', then check."""
    if os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)
    _fails(_job(Path(root)), r"data\.train_subdir: .*train is not readable")


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
    text = _fails(_job(good), re.escape(str(truncated)) + r": cannot open as HDF5 \(corrupt or truncated\?\)",
                  re.escape(str(corrupt)) + r": cannot open as HDF5")
    assert text.startswith("2 problem(s)")


def test_missing_field(good):
    path = good / "train" / "s002.h5"
    _rewrite(path, target=None)
    _fails(_job(good), re.escape(str(path)) + r": field 'target' is missing \(has \['volume'\]\)")


def test_wrong_shapes(good):
    rng = np.random.default_rng(1)
    small = good / "train" / "s000.h5"
    _rewrite(small, target=rng.uniform(-1, 1, (1, 3)).astype(np.float32))
    other = good / "val" / "s001.h5"
    _rewrite(other, volume=_sample(rng, 4)["volume"])
    _fails(_job(good), re.escape(str(small)) + r": field 'target' has sample shape \(3,\), want \(4,\)",
           re.escape(str(other)) + r": field 'volume' has sample shape \(4, 4, 4, 4\), want \(4, 8, 8, 8\)")


def test_wrong_dtype(good):
    path = good / "train" / "s003.h5"
    _rewrite(path, volume=np.zeros((1, 4, SIZE, SIZE, SIZE), np.float32))
    _fails(_job(good), re.escape(str(path)) + r": field 'volume' is float32, want int16")


def test_non_finite_targets(good):
    path = good / "val" / "s001.h5"
    target = np.array([[0.1, np.nan, 0.2, np.inf]], np.float32)
    _rewrite(path, target=target)
    _fails(_job(good), re.escape(str(path)) + r": field 'target' has 2 non-finite values \(NaN or inf\), "
                                              r"want all finite")


def test_manifest_that_disagrees_with_a_file(good):
    path = good / "train" / "s000.h5"
    with h5py.File(path, "r+") as f:
        f.attrs["samples"] = 1
    write_manifest(good / "train", "cosmoflow", counts={"s000.h5": 3})
    _fails(_job(good), re.escape(str(path)) + r": manifest\.json lists 3 samples, the file holds 1")
    (good / "train" / "manifest.json").write_text("{not json")
    _fails(_job(good), r"data\.train_subdir: .*manifest\.json cannot be read")


def test_deep_check_reads_voxels(good):
    path = good / "train" / "s001.h5"
    volume = np.zeros((1, 4, SIZE, SIZE, SIZE), np.int16)
    volume[0, 1, 2, 3, 4] = -5
    _rewrite(path, volume=volume)
    job = _job(good)
    assert check_data(job.data, job.model, COSMO, SERIAL)  # quick: voxels are not read
    _fails(_job(good, check="deep"), re.escape(str(path)) + r": field 'volume' has 1 values outside \[0, 32767\]")


@pytest.mark.parametrize("mode", ["fail", "skip"])
def test_non_finite_input_voxels(good, mode):
    path = good / "train" / "s002.h5"
    volume = np.zeros((1, 4, SIZE, SIZE, SIZE), np.int16)
    volume[0, 0, 5, 1, 1] = -1  # log(x + 1) of -1 is -inf
    _rewrite(path, volume=volume)
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


def test_volume_the_grid_cannot_split(good):
    _fails(_job(good), r"parallel\.spatial=\[16, 1, 1\] cannot split the volume \[8, 8, 8\] .*train.*"
                       r"dim D has 8 voxels for 16 blocks", grid=Grid((16, 1, 1), 16, 0))


def test_model_strides_the_grid_cannot_split():
    cfg = CosmoFlowConfig(conv_filters=4, n_conv_blocks=3, dense_sizes=[16])
    check_model(COSMO, cfg, (16, 16, 16), 4, Grid((2, 2, 1), 4, 0))  # 16 -> 8 -> 4 -> 2: splits 2 ways
    with pytest.raises(InputError, match=r"layer '[\w.]+' \(MaxPool3d\): output size 2 along dim D \(input 4\) "
                                         r"cannot be split 4 ways for parallel\.spatial=\[4, 1, 1\]"):
        check_model(COSMO, cfg, (16, 16, 16), 4, Grid((4, 1, 1), 4, 0))


def test_norm_layers_left_with_one_voxel_and_kernels_beyond_the_volume():
    from torch import nn

    from parallel.job.family import model_config
    from unet3d.family import FAMILY as UNET

    deep = model_config(UNET)  # the MLPerf U-Net: 5 stride-2 levels take 32^3 to 1^3
    for grid in (SERIAL, Grid((2, 1, 1), 2, 0)):  # the README's split, and serially (torch fails there too)
        with pytest.raises(InputError, match=r"layer 'down\.4\.0\.1' \(InstanceNorm3d\) normalises each channel over "
                                             r"its 1x1x1 voxel\(s\) at a volume of \[32, 32, 32\]: instance norm needs "
                                             r"more than one"):
            check_model(UNET, deep, (32, 32, 32), 1, grid, local_batch=64 // grid.data_size)
    check_model(UNET, deep, (64, 64, 64), 1, SERIAL, local_batch=64)  # 2^3 at the bottleneck: fine
    batch = model_config(UNET, ["model.norm=batch"])
    check_model(UNET, batch, (32, 32, 32), 1, SERIAL, local_batch=2)  # 2 samples per rank
    with pytest.raises(InputError, match=r"\(BatchNorm3d\) normalises each channel over 1x1x1 voxel\(s\) x 1 "
                                         r"sample\(s\) per rank .* train\.global_batch_size"):
        check_model(UNET, batch, (32, 32, 32), 1, Grid((1, 1, 1), 2, 0), local_batch=1)  # 2 over 2 data groups

    class Wide(nn.Module):  # a kernel wider than what reaches it: torch's own check, named by layer
        def __init__(self) -> None:
            super().__init__()
            self.pool = nn.MaxPool3d(4)
            self.conv = nn.Conv3d(1, 2, 5)

        def forward(self, x):
            return self.conv(self.pool(x))

    from dataclasses import replace

    wide = replace(UNET, build_model=lambda cfg, volume: Wide())
    with pytest.raises(InputError, match=r"layer 'conv' \(Conv3d\) cannot take its input of 1x4x4x4 voxels .* at a "
                                         r"volume of \[16, 16, 16\]"):
        check_model(wide, None, (16, 16, 16), 1, SERIAL)


def test_world_size_the_grid_does_not_divide():
    with pytest.raises(ValueError, match=r"world size 3 is not a multiple of the spatial group size 2x1x1 = 2"):
        Grid((2, 1, 1), 3, 0)


def test_config_values_and_types():
    job = CosmoFlowJob()
    job.parallel.spatial = [2, 1]
    with pytest.raises(ConfigError, match=r"parallel\.spatial=\[2, 1\]: want three positive ints"):
        validate_config(job)
    job = CosmoFlowJob()
    job.run.keep_checkpoints = 0
    with pytest.raises(ConfigError, match=r"run\.keep_checkpoints=0: want >= 1"):
        validate_config(job)
    register(COSMO)
    with initialize_config_dir(config_dir=str(CONFIG_ROOT / "cosmoflow"), version_base=None):
        with pytest.raises((ConfigCompositionException, ValidationError), match=r"train\.foo"):
            compose(config_name="quickstart", overrides=["train.foo=1"])
        with pytest.raises((ConfigCompositionException, ValidationError)) as info:
            compose(config_name="quickstart", overrides=["train.epochs=many"])
        assert "train.epochs" in str(info.value) or "train.epochs" in str(info.value.__cause__)
        with pytest.raises((ConfigCompositionException, ValidationError)) as info:
            to_dataclass(compose(config_name="quickstart", overrides=["data.nonfinite=ignore"]), CosmoFlowJob)
        assert "nonfinite" in str(info.value) + str(info.value.__cause__)
        added = compose(config_name="quickstart", overrides=["+train.foo=1", "+model.bar=2"])  # Hydra allows '+'
        with pytest.raises(UnknownKeyError, match=r"unknown config key\(s\) train\.foo, model\.bar"):
            to_dataclass(added, CosmoFlowJob)
    job = CosmoFlowJob()
    job.parallel.spatial = "abc"
    with pytest.raises(ConfigError, match=r"parallel\.spatial=abc: want three positive ints"):
        validate_config(job)
    job.parallel.spatial = "auto"  # a value the config accepts: the planner chooses at start-up
    validate_config(job)
    job.parallel.channels_last = "yes"
    with pytest.raises(ConfigError, match=r"parallel\.channels_last=yes: want true, false or auto"):
        validate_config(job)


@pytest.mark.unit
def test_channels_last_auto_is_on_only_where_it_was_measured_faster():
    import torch

    from parallel.split.layout import preferred

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)  # a device object needs no GPU
    assert preferred(cpu, "fp32")
    assert not any(preferred(cpu, p) for p in ("fp64", "bf16", "fp16"))
    assert not any(preferred(gpu, p) for p in ("fp32", "fp64", "bf16", "fp16"))


@pytest.mark.launch
def test_cli_reports_bad_input_cleanly(good, tmp_path):
    """Real launches: an unknown key (added with '+'), and a missing field under torchrun (2 ranks)."""
    proc = python_m("cosmoflow.train", ["--config-name", "quickstart", "+model.bar=2"], timeout=120)
    assert proc.returncode == 2 and "unknown config key(s) model.bar" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    path = good / "val" / "s001.h5"
    _rewrite(path, target=None)
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "-m", "cosmoflow.train",
           "--config-name", "quickstart", f"data.dir={good}", f"run.dir={tmp_path / 'run'}", "parallel.spatial=[2,1,1]",
           "train.global_batch_size=2", "model.conv_filters=4", "model.n_conv_blocks=2", "model.dense_sizes=[16]",
           "run.progress=false", "parallel.timeout_s=60"]
    proc = subprocess.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    mine = [line for line in out.splitlines() if "problem(s) in the sample files" in line]
    assert len(mine) == 1 and "[rank 0] ERROR" in mine[0], out[-3000:]  # once, from rank 0
    assert f"{path}: field 'target' is missing" in out
    # no traceback of ours (torchrun prints its own)
    assert not re.search(r'File ".*/(parallel|cosmoflow)/', out), out[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained


@pytest.mark.launch
def test_config_errors_exit_2_with_one_message_from_rank_0(tmp_path):
    """Hydra's own errors and the grid's, under plain python and mpirun (whose status is the
    ranks' when they leave together); the MLPerf U-Net on whole 32^3 cases split 2 ways."""
    def run(cmd: list[str]) -> tuple[int, str]:
        if cmd[0] == sys.executable:  # plain python: the session's job pool
            proc = python_m(cmd[2], cmd[3:], timeout=240)
        else:
            proc = subprocess.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True, timeout=240)
        return proc.returncode, proc.stdout + proc.stderr

    py = [sys.executable, "-m", "cosmoflow.train", "--config-name", "smoke"]
    mpi = [str(BIN / "mpirun"), "-n", "2", sys.executable, "-m", "cosmoflow.train", "--config-name", "smoke"]
    for cmd, said in ((py + ["train.foo=1"], "Could not override 'train.foo'"),
                      (py + ["train.epochs=many"], "Value 'many' of type 'str' could not be converted to Integer"),
                      (mpi + ["train.foo=1"], "Could not override 'train.foo'")):
        code, out = run(cmd)
        assert code == 2 and out.count(said) == 1 and "Traceback" not in out, out[-3000:]
    data = prepare("cosmoflow", tmp_path / "cosmo", 16, 2, 1)
    proc = python_m("cosmoflow.train", [*py[3:], f"data.dir={data}", "parallel.spatial=[2,1,1]"], nproc=3, timeout=240)
    code, out = proc.returncode, proc.stdout + proc.stderr
    assert code == 2 and out.count("data x spatial(2x1x1) cannot equal 3") == 1, out[-3000:]
    kits = prepare("unet3d", tmp_path / "kits", 32, 2, 1)
    # whole 32^3 cases (the default 128^3 crops would pad them): the bottleneck keeps one voxel
    proc = python_m("unet3d.train", [f"data.dir={kits}", "data.crop=null", "eval.mode=whole", "parallel.spatial=[2,1,1]",
                                     f"run.dir={tmp_path / 'u'}"], nproc=2, timeout=240)
    code, out = proc.returncode, proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if " ERROR " in line]
    assert code == 2 and len(errors) == 1 and "[rank 0]" in errors[0], out[-3000:]
    assert "layer 'down.4.0.1' (InstanceNorm3d)" in out and "1x1x1 voxel(s)" in out, out[-3000:]
    assert "Traceback" not in out and not (tmp_path / "u" / "checkpoints").exists()


@pytest.mark.launch
def test_help_names_the_program_and_its_keys():
    for model in ("cosmoflow", "unet3d"):
        proc = python_m(f"{model}.train", ["--help"], timeout=120)
        out = proc.stdout
        assert proc.returncode == 0 and out.startswith(f"python -m {model}.train: Train "), out[:500]
        assert "powered by Hydra" not in out
        for part in ("Configs (--config-name", "quickstart", "Config sections: data, parallel, train",
                     "data.dir=DIR", "parallel.spatial=[sd,sh,sw]", "train.resume=true", "run.overwrite=true",
                     f"python -m {model}.prepare synthetic", "spatial_slurm", "--multirun"):
            assert part in out, (part, out)
