"""The training loop sets the MLPerf HPC CosmoFlow reference's learning rate at every step
of a real run. (The schedules and optimiser steps themselves:
tests/unit/test_schedule_reference.py.)"""

import pytest

from schedules import hpc_reference_lr


def test_the_loop_sets_the_reference_rate_at_every_step(tmp_path):
    """The real loop, 70 epochs of 2 steps: the rate of every step (metrics.jsonl, what the
    step set in the optimiser) is the HPC reference's, held per epoch, with the schema's
    schedule (warmup 4 epochs, decay after 32 and 64); the peak is scaled for batch 4 by
    optim.lr_scale_batch=2 so that the warmup rises, as at the reference's batches. The
    evaluations follow eval.start_epoch and train.eval_every (from epoch 61, every 4)."""
    import json

    from train_helpers import launch, prepare

    data = prepare("cosmoflow", tmp_path / "data", 16, 8, 2)
    run = tmp_path / "run"
    launch("cosmoflow", 1, ["--config-name", "default", f"data.dir={data}", f"run.dir={run}", "data.workers=0",
                            "model.conv_filters=2", "model.n_conv_blocks=2", "model.dense_sizes=[8]",
                            "train.global_batch_size=4", "train.epochs=70", "train.eval_every=4",
                            "eval.start_epoch=61", "train.eval_at_end=false", "train.stop_at_target=false",
                            "optim.lr_scale_batch=2", "run.log_every=1",
                            "run.progress=false", "run.tensorboard=false", "mlperf.enabled=false"], timeout=600)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in rows if r["kind"] == "train"}
    assert sorted(lrs) == list(range(1, 141))
    assert [r["epoch"] for r in rows if r["kind"] == "eval"] == [61, 65, 69]
    for step, lr in lrs.items():
        epoch = (step - 1) // 2  # 2 steps per epoch; the row of step k holds the rate of step k - 1 (0-based)
        want = hpc_reference_lr(epoch, 128)  # batch 128 at 64: the same peak, 2 x 0.001, as batch 4 at 2
        assert lr == pytest.approx(want, rel=1e-12), (step, epoch, lr, want)
