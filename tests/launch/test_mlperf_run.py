"""A short closed-division U-Net run over 168/42 cases logs every key the MLPerf Training
rules ask for, checked by the compliance checker. (The keys and pieces of the reference
procedure: tests/unit/test_mlperf_unet.py.)"""

import subprocess
import sys
from pathlib import Path


def _check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                           "--ruleset", "4.0.0", str(path)], capture_output=True, text=True, timeout=120,
                          cwd=path.parent)  # the checker writes compliance_checker.log where it runs



def test_a_short_closed_run_over_168_42_cases_logs_every_key_the_rules_ask_for(tmp_path):
    """The MLPerf config itself (configs/unet3d/default.yaml), made small only where time
    needs it: 168/42 generated cases of 16..24 voxels per side, 16^3 crops and window, a
    2-level network of 2..4 filters, one epoch (the evaluation at the end). The closed
    checker's only complaint is the unreached target; the open one passes."""
    import json

    from train_helpers import launch, python_m

    data = tmp_path / "kits_like"
    made = python_m("unet3d.prepare", ["synthetic", "--out", str(data), "--size-range", "16,24", "--crop", "16",
                                       "--train", "168", "--val", "42", "--seed", "0", "--quiet", "--workers", "1"],
                    timeout=600)
    assert made.returncode == 0, made.stderr[-3000:]
    run = tmp_path / "run"
    launch("unet3d", 1, [f"data.dir={data}", f"run.dir={run}", "data.crop=[16,16,16]", "data.workers=0",
                         "model.depth=2", "model.base_filters=2", "model.max_filters=4", "train.epochs=1",
                         "run.progress=false", "run.tensorboard=false"], timeout=900)
    log = run / "mlperf.log"
    records = [json.loads(line.split(" ", 1)[1]) for line in log.read_text().splitlines() if line.startswith(":::MLLOG")]
    keys = {r["key"]: r["value"] for r in records}
    assert keys["submission_division"] == "closed" and keys["train_samples"] == 168 and keys["eval_samples"] == 42
    assert (keys["evaluation_start_epoch"], keys["evaluation_frequency"], keys["oversampling"]) == (1000, 20, 0.4)
    assert keys["validation_input_shape"] == [16, 16, 16] and keys["validation_overlap"] == 0.5
    evals = [r["metadata"]["epoch_num"] for r in records if r["key"] == "eval_accuracy"]
    assert evals == [1]  # before evaluation_start_epoch: only the evaluation at the end
    proc = _check(log)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "eval_accuracy" in out
    assert [line for line in out.splitlines() if "ERROR" in line and "eval_accuracy" not in line
            and "FAILED" not in line] == [], out
    (tmp_path / "open").mkdir()
    text = log.read_text().replace('"value": "closed"', '"value": "open"')
    (tmp_path / "open" / "mlperf.log").write_text(text)
    proc = _check(tmp_path / "open" / "mlperf.log")
    assert proc.returncode == 0, proc.stdout + proc.stderr
