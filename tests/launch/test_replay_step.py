"""A suspicious step replayed (``train.replay``, ``parallel.train.replay``): a bit flipped in
one rank's gradient (``SPATIALCNN_FLIP_BIT ... at=grad``) is transient, its rank named, and
the run ends with an undisturbed run's weights, bit for bit; a bad sample (a target of
1e30: its loss overflows) gives the same numbers twice, so its step's samples are named
and ``train.nonfinite=fail`` stops the run."""

import json

import h5py
import pytest
import torch

from train_helpers import launch, prepare, prepare_copy, weights

TINY = ["--config-name", "quickstart", "train.global_batch_size=4", "model.conv_filters=4", "model.n_conv_blocks=2",
        "model.dense_sizes=[16]", "model.input_shift=3.8", "model.input_scale=2.0", "optim.lr=0.02",
        "model.dropout=0.0", "run.progress=false", "run.log_rank=-3", "run.tensorboard=false", "train.eval_every=0",
        "train.eval_at_end=false", "data.workers=0", "mlperf.enabled=false", "train.max_steps=4",
        "parallel.spatial=[2,1,1]"]



@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare("cosmoflow", tmp_path_factory.mktemp("cosmo16"), 16, 16, 4)  # test_fail_checkpoint's set



def test_a_flipped_bit_in_a_gradient_is_transient_and_the_run_ends_undisturbed(data, tmp_path):
    fault = {"SPATIALCNN_FLIP_BIT": "step=3,rank=1,tensor=features.0.bias,bit=30,at=grad"}
    hit = launch("cosmoflow", 2, [*TINY, f"data.dir={data}", f"run.dir={tmp_path / 'hit'}", "train.replay=true"],
                 extra_env=fault, timeout=120)
    assert "rank 1: gradient norm inf); replaying it from the state before it with the same batch" in hit.stderr
    assert "step 3: a transient fault on rank 1: the replay gave other numbers" in hit.stderr, hit.stderr[-3000:]
    summary = json.loads((tmp_path / "hit" / "summary.json").read_text())
    replayed = summary["replayed_steps"]
    assert (replayed["transient"], replayed["persistent"], summary["steps"]) == (1, 0, 4), summary
    launch("cosmoflow", 2, [*TINY, f"data.dir={data}", f"run.dir={tmp_path / 'calm'}"], timeout=120)
    a, b = weights(tmp_path / "hit"), weights(tmp_path / "calm")
    assert all(torch.equal(a[k], b[k]) for k in a), "the replayed run ends where the undisturbed one does"



def test_a_bad_sample_gives_the_same_numbers_twice_and_is_named(tmp_path):
    data = prepare_copy("cosmoflow", tmp_path / "bad", 16, 16, 4)
    bad = data / "train" / "sample_000001.h5"
    with h5py.File(bad, "r+") as f:
        f["target"][...] = 1e30  # finite, so the file checks pass; its squared error overflows
    proc = launch("cosmoflow", 2, [*TINY, f"data.dir={data}", f"run.dir={tmp_path / 'run'}", "train.replay=true"],
                  check=False, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "the replay gave the same numbers on every rank" in line]
    assert said and str(bad) + "[0]" in said[0], proc.stderr[-3000:]
    assert "non-finite gradients (norm inf" in proc.stderr and "stopping (train.nonfinite=fail)" in proc.stderr



def test_a_spike_replayed_to_the_same_numbers_is_a_bad_step(data, tmp_path):
    # one rank; any gradient norm 1% above its running average is a "spike": the first such
    # step is replayed, gives the same norm, and train.nonfinite=fail stops the run at it
    proc = launch("cosmoflow", 1, [*TINY[:-1], f"data.dir={data}", f"run.dir={tmp_path / 'run'}", "train.replay=true",
                                   "train.spike_factor=1.01"], check=False, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "step 2: suspicious (rank 0: gradient norm" in proc.stderr
    assert "the replay gave the same numbers on every rank" in proc.stderr
    assert "above train.spike_factor=1.01 x its running average" in proc.stderr, proc.stderr[-3000:]
    assert "the same when replayed (samples " in proc.stderr and "stopping (train.nonfinite=fail)" in proc.stderr
