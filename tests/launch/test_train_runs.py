"""Never lose a result: a used run.dir is refused byte for byte, overwrite keeps the old
run aside, a refused resume leaves every log whole, a resume reports this session's figures,
and the summary says why a run ended. (The rule's pieces: tests/unit/test_rundir.py.)"""

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from train_helpers import prepare, python_m

SMALL = ["--config-name", "smoke", "run.log_rank=0"]



@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare("cosmoflow", tmp_path_factory.mktemp("cosmo16"), 16, 8, 4)



def _train(*overrides: str) -> subprocess.CompletedProcess:
    return python_m("cosmoflow.train", [*SMALL, *overrides], timeout=180)



def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}



def test_a_used_run_dir_is_refused_overwritten_aside_or_resumed(data, tmp_path):
    run = tmp_path / "R"
    args = [f"data.dir={data}", f"run.dir={run}"]
    first = _train(*args, "train.max_steps=3")
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "max_steps" and "stopped at train.max_steps" in first.stderr
    assert summary["run_dir"] == str(run) and f"run.dir: {run}" in first.stderr
    before = _hashes(run)

    again = _train(*args, "train.max_steps=3", "optim.lr=0.01")  # "try it again with another setting"
    assert again.returncode == 2, again.stderr[-3000:]
    errors = [line for line in again.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "Traceback" not in again.stderr, again.stderr[-3000:]
    for part in (f"run.dir={run} already holds a run (a checkpoint at step 3", "train.resume=true",
                 "run.dir=ANOTHER_DIR", "run.overwrite=true", f"{run / 'previous_<k>'}"):
        assert part in errors[0], errors[0]
    assert _hashes(run) == before  # every byte of the first run

    wrong = _train(*args, "train.max_steps=6", "train.resume=true", "model.conv_filters=8")
    assert wrong.returncode == 2 and "was written for another model" in wrong.stderr, wrong.stderr[-3000:]
    assert _hashes(run) == before  # a refused resume moves and cuts nothing: mlperf.log byte-identical

    resumed = _train(*args, "train.max_steps=6", "train.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    s = json.loads((run / "summary.json").read_text())
    assert s["steps"] == 6 and s["session"]["first_step"] == 3 and s["session"]["steps"] == 3
    assert s["session"]["samples"] == 3 * 4 and "resumed at step 3" in resumed.stderr
    # this session's samples over this session's time, not every sample since step 0
    assert s["samples_per_s"] == pytest.approx(s["session"]["samples"] / s["train_seconds"], rel=1e-6)
    assert s["run_seconds"] <= s["run_seconds_all_sessions"]
    old_log = (run / "mlperf.log.1").read_text()
    assert hashlib.sha256(old_log.encode()).hexdigest() == before["mlperf.log"]  # kept whole, aside

    over = _train(*args, "train.max_steps=2", "run.overwrite=true")
    assert over.returncode == 0, over.stderr[-3000:]
    aside = run / "previous_1"
    assert f"its files moved to {aside}" in over.stderr
    assert (aside / "checkpoints" / "last.pt").is_file() and (aside / "mlperf.log.1").is_file()
    assert json.loads((aside / "summary.json").read_text())["steps"] == 6
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
