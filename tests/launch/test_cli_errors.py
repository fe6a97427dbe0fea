"""Bad input through the real entry points: one message from rank 0, no traceback of
ours, a non-zero status (2 for a config error), nothing trained; ``--help`` names the keys."""

import re
import subprocess
import sys

import pytest

from sample_sets import make_set, rewrite
from train_helpers import BIN, REPO, env, prepare, python_m


@pytest.fixture
def good(tmp_path):
    return make_set(tmp_path / "set")


def test_cli_reports_bad_input_cleanly(good, tmp_path):
    """Real launches: an unknown key (added with '+'), and a missing field under torchrun (2 ranks)."""
    proc = python_m("cosmoflow.train", ["--config-name", "quickstart", "+model.bar=2"], timeout=120)
    assert proc.returncode == 2 and "unknown config key(s) model.bar" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    path = good / "val" / "s001.h5"
    rewrite(path, target=None)
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
