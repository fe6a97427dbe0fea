"""The run-directory rule's pieces as pure functions (``parallel/train/persist/rundir.py``).
(The rule on real runs: tests/launch/test_train_runs.py.)"""

import pytest

from parallel.train.persist import rundir


def test_rundir_rule_as_functions(tmp_path):
    run = tmp_path / "r"
    assert rundir.held(run) is None and "a new run" in rundir.prepare(str(run), False, False)
    run.mkdir()
    (run / "config.yaml").write_text("x")  # a launch that stopped before training: not a run
    assert rundir.held(run) is None
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 4}\n{"kind": "train", "step": 7}\n')
    found = rundir.held(run)
    assert found is not None and found.step == 7 and found.checkpoint is None
    with pytest.raises(rundir.RunDirError, match=r"logs up to step 7 and no checkpoint"):
        rundir.prepare(str(run), False, False)
    # resume with nothing to resume from: the logs move aside, a new run starts
    note = rundir.prepare(str(run), True, False)
    assert "previous_1" in note and (run / "previous_1" / "metrics.jsonl").is_file()
    assert sorted(p.name for p in run.iterdir()) == ["previous_1"]
    (run / "mlperf.log").write_text(":::MLLOG {}\n")
    assert "previous_2" in rundir.prepare(str(run), False, True)
    assert (run / "previous_2" / "mlperf.log").is_file() and (run / "previous_1" / "metrics.jsonl").is_file()
