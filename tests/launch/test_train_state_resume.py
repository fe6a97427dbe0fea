"""A checkpoint written before the training state had its own module
(``tests/support/data/resume_v0``: a tiny serial CosmoFlow run of 2 epochs, 2 steps each,
dropout on, written by the earlier trainer) still resumes, to the very weights the
earlier run reached."""

from pathlib import Path

import pytest

from parallel.job import checkpoint
from train_helpers import launch, max_rel_diff, prepare

FIXTURE = Path(__file__).resolve().parents[1] / "support" / "data" / "resume_v0"



# How the fixture was written (python -m cosmoflow.train, before the split of the loop).
ARGS = ["--config-name", "quickstart", "train.global_batch_size=4", "train.epochs=2", "model.conv_filters=2",
        "model.n_conv_blocks=2", "model.dense_sizes=[8]", "model.dropout=0.5", "run.keep_checkpoints=3",
        "run.progress=false", "run.log_every=1", "run.tensorboard=false"]



def test_resuming_an_earlier_checkpoint_reaches_the_earlier_weights(tmp_path: Path):
    data = prepare("cosmoflow", tmp_path / "data", 8, 8, 4)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.pt").write_bytes((FIXTURE / "epoch1.pt").read_bytes())
    proc = launch("cosmoflow", 1, [*ARGS, f"data.dir={data}", f"run.dir={run}", "train.resume=true",
                                   "data.workers=0"])
    assert "resumed from" in proc.stderr + proc.stdout
    mine = checkpoint.load(run / "checkpoints" / "last.pt")
    theirs = checkpoint.load(FIXTURE / "epoch2.pt")
    assert mine["step"] == theirs["step"] == 4
    # The same run: bit for bit on the machine that wrote the fixture; 1e-5 leaves room for
    # another CPU's kernels summing in another order.
    worst, key = max_rel_diff(theirs["model"], mine["model"])
    assert worst < 1e-5, f"{key}: {worst}"
    assert mine["best_metric"] == pytest.approx(theirs["best_metric"], rel=1e-5)
