"""Checkpoints survive kills; non-finite steps stop or skip cleanly.

The kill test runs the real entry point with ``torch.save`` slowed down (a wrapper writes
half of the checkpoint, then waits), kills it with SIGKILL in the middle of that write,
and resumes: the previous checkpoint must load and the resumed run must end with the
uninterrupted run's weights, optimiser and K-FAC state, bit for bit (the suite's one
whole/kill/resume proof: ``tests/launch/test_train_resume.py`` and
``tests/launch/test_kfac_train.py`` rely on it). Rotation and refusals of the files
themselves: tests/unit/test_checkpoint.py."""

import json
import os
import re

import pytest
import torch

from parallel.job import checkpoint
from train_helpers import kill_during_checkpoint_write, launch, prepare, python_m, weights

TINY = ["--config-name", "quickstart", "train.global_batch_size=4", "model.conv_filters=4", "model.n_conv_blocks=2",
        "model.dense_sizes=[16]", "model.input_shift=3.8", "model.input_scale=2.0", "optim.lr=0.02",
        "run.progress=false", "run.log_rank=-3", "run.tensorboard=false", "train.eval_every=0",
        "train.eval_at_end=false", "data.workers=0"]



# Factors every 2 steps and eigendecompositions every 4, so that a resume lands between updates of both.
KFAC = ["optim.name=kfac", "optim.kfac.factor_interval=2", "optim.kfac.inverse_interval=4", "optim.kfac.damping=0.01",
        "optim.lr=0.01"]



@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare("cosmoflow", tmp_path_factory.mktemp("cosmo16"), 16, 16, 4)



def test_kill_during_checkpoint_write_then_resume(data, tmp_path):
    # The one whole / kill -9 / resume proof (it carried three before: SGD, K-FAC, mid-write).
    # K-FAC (an SGD with momentum underneath) with dropout on: the resume must restore the
    # weights, SGD's momentum, K-FAC's factors and eigendecompositions, and every RNG stream.
    # Checkpoints every 3 steps (and at each epoch's end, 4 steps), the kill in the write of
    # step 4: the resume starts at step 3,
    # between K-FAC's factor (every 2) and inverse (every 4) updates.
    args = [*TINY, *KFAC, f"data.dir={data}", "model.dropout=0.5", "train.epochs=3", "run.checkpoint_every=3",
            "train.eval_every=2"]
    whole = tmp_path / "whole"
    launch("cosmoflow", 1, [*args, f"run.dir={whole}"])

    cut = tmp_path / "cut"
    said = kill_during_checkpoint_write([*args, f"run.dir={cut}", "run.keep_checkpoints=2"], 4, tmp_path / "writing")
    assert said.split()[0] == "4"  # killed in the middle of writing step 4
    ckpt_dir = cut / "checkpoints"
    partial = ckpt_dir / ".last.pt.tmp"
    assert partial.exists() and partial.stat().st_size > 0
    with pytest.raises(checkpoint.CheckpointError, match="cannot be read"):
        checkpoint.load(partial)
    at_kill = checkpoint.load(ckpt_dir / "last.pt")["step"]
    assert at_kill == 3  # the previous checkpoint is intact
    assert [p.name for p in checkpoint.kept(ckpt_dir)] == ["step_000000003.pt"]
    assert not (cut / "summary.json").exists()
    saved = checkpoint.load(ckpt_dir / "last.pt")["optimizer"]["kfac"]
    assert saved["steps"] == at_kill and saved["layers"], "the checkpoint holds K-FAC's counter and factors"

    launch("cosmoflow", 1, [*args, f"run.dir={cut}", "run.keep_checkpoints=2", "train.resume=true"])
    a, b = weights(whole), weights(cut)
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resuming from a checkpoint killed mid-write"
    assert [p.name for p in checkpoint.kept(ckpt_dir)] == ["step_000000009.pt", "step_000000012.pt"]
    assert os.path.samefile(ckpt_dir / "last.pt", ckpt_dir / "step_000000012.pt")
    ca, cb = checkpoint.load(whole / "checkpoints" / "last.pt"), checkpoint.load(ckpt_dir / "last.pt")
    assert ca["step"] == cb["step"] == 12
    for (_, sa), (_, sb) in zip(ca["optimizer"]["state"].items(), cb["optimizer"]["state"].items()):
        assert sa.keys() == sb.keys()
        for name in sa:  # SGD's momentum buffers
            assert torch.equal(torch.as_tensor(sa[name]), torch.as_tensor(sb[name])), f"optimiser {name} differs"
    ka, kb = ca["optimizer"]["kfac"], cb["optimizer"]["kfac"]
    assert ka["steps"] == kb["steps"] == 12 and ka["layers"].keys() == kb["layers"].keys()
    for layer, entry in ka["layers"].items():
        assert entry.keys() == {"A", "G", "QA", "lA", "QG", "lG"}
        for name, t in entry.items():
            assert torch.equal(t, kb["layers"][layer][name]), f"K-FAC {name} of {layer} differs"
    meta = cb["meta"]  # what a resume compares (test below)
    assert meta["family"] == "cosmoflow" and meta["model"]["conv_filters"] == 4 and meta["volume"] == [16, 16, 16]
    # metrics.jsonl holds each step once: the repeated steps were rewritten, not appended
    rows = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if r["kind"] == "train"]
    assert steps == sorted(set(steps))
    # the interrupted run's MLPerf log is kept aside; the resumed run's log is whole on its own
    assert (cut / "mlperf.log.1").is_file()
    log = [json.loads(line.split(":::MLLOG ", 1)[1]) for line in (cut / "mlperf.log").read_text().splitlines()]
    keys = [r["key"] for r in log]
    assert keys.count("init_start") == 1 and keys[-1] == "run_stop"
    values = {r["key"]: r["value"] for r in log}
    assert values["opt_name"] == "kfac" and values["submission_division"] == "open"
    assert values["opt_kfac_factor_interval"] == 2 and values["opt_kfac_inverse_interval"] == 4



def test_nonfinite_gradients_stop_or_skip_keeping_the_last_good_checkpoint(data, tmp_path):
    # A learning rate of 1e30 makes the weights after step 1 overflow the next forward.
    args = [*TINY, f"data.dir={data}", "model.dropout=0.0", "optim.lr=1e30", "train.max_steps=8",
            "run.checkpoint_every=1"]
    run = tmp_path / "fail"
    proc = python_m("cosmoflow.train", [*args, f"run.dir={run}"], timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    found = re.search(r"step (\d+): non-finite gradients \(norm (nan|inf)", proc.stderr)
    assert found, proc.stderr[-3000:]
    bad = int(found.group(1))
    assert f"the last good checkpoint is {run / 'checkpoints' / 'last.pt'} (step {bad - 1})" in proc.stderr
    ckpt = checkpoint.load(run / "checkpoints" / "last.pt")
    assert ckpt["step"] == bad - 1 and all(torch.isfinite(v).all() for v in ckpt["model"].values())

    run = tmp_path / "skip"
    proc = python_m("cosmoflow.train", [*args, f"run.dir={run}", "train.nonfinite=skip", "train.max_skipped_steps=2"],
                    timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.count("update skipped (train.nonfinite=skip") == 2, proc.stderr[-3000:]
    assert "3 steps in a row were non-finite (train.max_skipped_steps=2)" in proc.stderr
    ckpt = checkpoint.load(run / "checkpoints" / "last.pt")
    assert ckpt["skipped_steps"] == 2 and all(torch.isfinite(v).all() for v in ckpt["model"].values())
