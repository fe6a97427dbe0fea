"""Silent corruption caught: a bit flipped on one rank (``SPATIALCNN_FLIP_BIT``,
``parallel.train.faults``) stops the job within one ``train.replica_check_every`` interval,
naming the step, the tensor and the rank, and the last checkpoint is the last one taken
from agreeing replicas (it says so). No false alarm: the equivalence matrix
(tests/launch/test_contract_matrix.py) runs every case with the check at every step."""

import pytest
import torch

from parallel.job import checkpoint
from train_helpers import launch, prepare

TINY = ["--config-name", "quickstart", "train.global_batch_size=4", "model.conv_filters=4", "model.n_conv_blocks=2",
        "model.dense_sizes=[16]", "model.input_shift=3.8", "model.input_scale=2.0", "optim.lr=0.02",
        "model.dropout=0.0", "run.progress=false", "run.log_rank=-3", "run.tensorboard=false", "train.eval_every=0",
        "train.eval_at_end=false", "data.workers=0", "mlperf.enabled=false", "train.max_steps=6",
        "train.replica_check_every=2", "run.checkpoint_every=2"]



@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare("cosmoflow", tmp_path_factory.mktemp("cosmo16"), 16, 16, 4)  # test_fail_checkpoint's set



def _flipped(data, run, nproc, spatial, fault):
    proc = launch("cosmoflow", nproc, [*TINY, f"data.dir={data}", f"parallel.spatial={spatial}", f"run.dir={run}"],
                  check=False, extra_env={"SPATIALCNN_FLIP_BIT": fault}, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    # the flip after step 3, the check after step 4: nothing written after the divergence
    ckpt = checkpoint.load(run / "checkpoints" / "last.pt")
    assert ckpt["step"] == 2 and ckpt["replicas"] == {"checked": True, "agree": True, "step": 2, "world_size": nproc}
    assert f"the last good checkpoint is {run / 'checkpoints' / 'last.pt'} (step 2)" in proc.stderr
    return proc.stderr



def test_a_bit_flipped_in_a_replicated_weight_of_the_spatial_group_is_caught(data, tmp_path):
    # two copies (spatial 2x1x1): no majority, so both ranks are named
    err = _flipped(data, tmp_path / "s2", 2, "[2,1,1]", "step=3,rank=1,tensor=features.0.bias,bit=22")
    assert "fault injected (SPATIALCNN_FLIP_BIT): rank 1, step 3, weight of 'features.0.bias'" in err
    assert "step 4: replicas disagree in 1 tensor(s):\n" in err, err[-3000:]
    assert "'features.0.bias': ranks [0, 1] hold different copies and no majority says which is wrong" in err



def test_a_bit_flipped_in_one_data_replica_is_caught_and_its_rank_named(data, tmp_path):
    # data 2 x spatial 2: four copies of a convolution's weight, rank 2's is odd
    err = _flipped(data, tmp_path / "d2s2", 4, "[2,1,1]", "step=3,rank=2,tensor=features.0.weight,bit=3,index=5")
    assert "step 4: replicas disagree in 1 tensor(s); the odd rank: rank 2:\n" in err, err[-3000:]
    assert "'features.0.weight': rank 2 differs from the other 3 copies (copies on every rank)" in err
