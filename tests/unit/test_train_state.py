"""The training state a checkpoint holds (``parallel/train/persist/state.py``): one object
saves and restores it, naming each key once, and a checkpoint written before the state had
its own module (``tests/support/data/resume_v0``) loads into it. (Resuming that checkpoint
to the earlier run's weights: tests/launch/test_train_state_resume.py.)"""

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

FIXTURE = Path(__file__).resolve().parents[1] / "support" / "data" / "resume_v0"



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
