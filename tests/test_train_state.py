"""The training state a checkpoint holds: one object saves and restores it, and checkpoints
written before the state had its own module (``tests/data/resume_v0``: a tiny serial
CosmoFlow run of 2 epochs, 2 steps each, dropout on, written by the earlier trainer)
still resume, to the very weights the earlier run reached."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cosmoflow.family import FAMILY
from parallel.data.loader import StepStats
from parallel.grid import Grid
from parallel.job import checkpoint
from parallel.job.family import model_config
from parallel.train.optim import build_optimizer
from parallel.train.persist.state import IOCounters, Progress, TrainState
from train_helpers import launch, max_rel_diff, prepare

FIXTURE = Path(__file__).resolve().parent / "data" / "resume_v0"
# How the fixture was written (python -m cosmoflow.train, before the split of the loop).
ARGS = ["--config-name", "quickstart", "train.global_batch_size=4", "train.epochs=2", "model.conv_filters=2",
        "model.n_conv_blocks=2", "model.dense_sizes=[8]", "model.dropout=0.5", "run.keep_checkpoints=3",
        "run.progress=false", "run.log_every=1", "run.tensorboard=false"]
SERIAL = Grid((1, 1, 1), 1, 0)


def _state(ckpt: dict) -> TrainState:
    cfg = model_config(FAMILY, [a for a in ARGS if a.startswith("model.")])
    torch.manual_seed(0)
    model = FAMILY.build_model(cfg, (8, 8, 8))
    job = FAMILY.config_class()
    optimizer = build_optimizer(model.parameters(), job.optim)
    meta = {k: v for k, v in ckpt["meta"].items() if k not in ("spatial", "world_size")}
    return TrainState(model, optimizer, None, 2, meta)


def test_progress_round_trips_and_names_each_key_once():
    p = Progress(step=7, epoch=3, samples=28, best=0.5, reached_s=1.5, run_s=2.5, skipped_samples=1, skipped_steps=2)
    p.io.add(StepStats(samples=4, bytes_read=1000, read_seconds=0.1, wait_seconds=0.25))
    saved = p.state_dict()
    assert set(saved) == {"step", "epoch", "samples", "best_metric", "reached_seconds", "run_seconds", "io",
                          "skipped_samples", "skipped_steps"}
    assert saved["io"] == {"bytes_read": 1000.0, "wait_seconds": 0.25, "samples": 4.0}
    q = Progress()
    q.load_state_dict(saved)
    assert q == p
    # The earlier layout: the counters as a positional float64 tensor.
    assert IOCounters.from_state(torch.tensor([1000.0, 0.25, 4.0], dtype=torch.float64)) == p.io


def test_a_checkpoint_of_the_earlier_trainer_loads_into_the_state():
    ckpt = checkpoint.load(FIXTURE / "epoch1.pt")
    state = _state(ckpt)
    state.load_state_dict(ckpt, FIXTURE / "epoch1.pt")
    p = state.progress
    assert (p.step, p.epoch, p.samples) == (ckpt["step"], ckpt["epoch"], ckpt["samples"]) == (2, 1, 8)
    assert p.best == ckpt["best_metric"] and p.reached_s == ckpt["reached_seconds"]
    assert p.run_s == ckpt["run_seconds"] and p.io == IOCounters(*ckpt["io"].tolist())
    for k, v in state.model.state_dict().items():
        assert torch.equal(v, ckpt["model"][k]), k
    again = state.state_dict(SERIAL)
    assert set(ckpt) - {"rng"} == set(again)  # the same keys as the earlier trainer wrote
    assert again["sampler"] == ckpt["sampler"] and again["meta"] == ckpt["meta"]
    other = dict(ckpt, meta=dict(ckpt["meta"], volume=[16, 16, 16]))
    with pytest.raises(checkpoint.CheckpointError, match=r"volume: checkpoint \[16, 16, 16\], this run \[8, 8, 8\]"):
        _state(ckpt).load_state_dict(other, "x.pt")


@pytest.mark.launch
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
