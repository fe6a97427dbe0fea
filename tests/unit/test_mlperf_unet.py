"""The U-Net's MLPerf Training log keys and pieces of the reference procedure. (A short
closed run logging them: tests/launch/test_mlperf_run.py.)"""

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from mlperf_logging.mllog import constants as C

from parallel.grid import Grid
from parallel.job.config import to_dataclass
from parallel.train.cli import CONFIG_ROOT, register
from parallel.train.evaluate import evaluation_due
from parallel.train.observe.mlperf import MLPerfLog, log_submission
from unet3d.family import FAMILY as UNET
from unet3d.family import brightness_scale


def _job(name: str, overrides: list[str]):
    register(UNET)
    with initialize_config_dir(config_dir=str(CONFIG_ROOT / "unet3d"), version_base=None):
        return to_dataclass(compose(config_name=name, overrides=overrides), UNET.config_class)



def _write_log(path: Path, job, train: int, val: int, dice: float) -> None:
    """What the loop writes around log_submission: staging, init, epochs, an eval, the end."""
    ml = MLPerfLog(path)
    log_submission(ml, job, Grid((1, 1, 1), 1, 0), "unet3d", n_nodes=1)
    ml.start(C.STAGING_START)
    ml.end(C.STAGING_STOP, staging_duration=0.0)
    ml.event(C.TRAIN_SAMPLES, train)
    ml.event(C.EVAL_SAMPLES, val)
    ml.end(C.INIT_STOP)
    ml.start(C.RUN_START)
    for epoch in (1, 2):
        ml.start(C.EPOCH_START, epoch_num=epoch)
        ml.end(C.EPOCH_STOP, epoch_num=epoch)
    ml.start(C.EVAL_START, epoch_num=2)
    ml.event(C.EVAL_ACCURACY, dice, epoch_num=2)
    ml.end(C.EVAL_STOP, epoch_num=2)
    ml.end(C.RUN_STOP, status="success" if dice >= 0.908 else "aborted")
    ml.close()



def _check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                           "--ruleset", "4.0.0", str(path)], capture_output=True, text=True, timeout=120,
                          cwd=path.parent)  # the checker writes compliance_checker.log where it runs



def test_the_mlperf_unet_config_logs_every_key_the_closed_rules_ask_for(tmp_path):
    job = _job("default", ["mlperf.division=closed"])
    assert job.data.crop == [128, 128, 128] and job.data.oversampling == 0.4
    assert (str(job.eval.mode), job.eval.start_epoch, job.train.eval_every) == ("sliding", 1000, 20)
    _write_log(tmp_path / "closed.log", job, 168, 42, 0.91)
    proc = _check(tmp_path / "closed.log")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = (tmp_path / "closed.log").read_text()
    for key, value in [("oversampling", "0.4"), ("training_input_shape", "[128, 128, 128]"),
                       ("validation_input_shape", "[128, 128, 128]"), ("validation_overlap", "0.5"),
                       ("gradient_accumulation_steps", "1"), ("opt_momentum", "0.9")]:
        assert f'"key": "{key}", "value": {value}' in text, key
    # a run short of the target: the closed checker's only complaint is the accuracy
    _write_log(tmp_path / "short.log", job, 168, 42, 0.5)
    proc = _check(tmp_path / "short.log")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "eval_accuracy" in out
    assert [line for line in out.splitlines() if "ERROR" in line and "eval_accuracy" not in line
            and "FAILED" not in line] == [], out



def test_the_quickstart_log_passes_the_open_division(tmp_path):
    job = _job("quickstart", [])
    assert str(job.mlperf.division) == "open"
    _write_log(tmp_path / "open.log", job, 64, 16, 0.93)
    proc = _check(tmp_path / "open.log")
    assert proc.returncode == 0, proc.stdout + proc.stderr



def test_brightness_as_the_reference_code_computes_it():
    # the reference multiplies by 1 + U(0.7, 1.3); the intended change is U(0.7, 1.3)
    assert brightness_scale(0.0, 0.3, "reference") == pytest.approx(1.7)
    assert brightness_scale(0.5, 0.3, "reference") == pytest.approx(2.0)
    assert brightness_scale(0.999999, 0.3, "reference") == pytest.approx(2.3, abs=1e-5)
    assert brightness_scale(0.0, 0.3, "intended") == pytest.approx(0.7)
    assert brightness_scale(0.5, 0.3, "intended") == pytest.approx(1.0)



def test_evaluation_starts_at_start_epoch_then_every_n():
    due = [e for e in range(1, 1101) if evaluation_due(e, 20, 1000)]
    assert due == [1000, 1020, 1040, 1060, 1080, 1100]
    assert [e for e in range(1, 9) if evaluation_due(e, 2)] == [2, 4, 6, 8]
    assert not any(evaluation_due(e, 0, 5) for e in range(1, 20))
