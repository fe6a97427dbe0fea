"""Random draws in a network's forward, through the training loop: a draw per sample
(stochastic depth) trained at 2x1x1 ends with the serial run's weights (the stream seeded
per data group, not per rank), and a draw shaped like the volume is stopped by the
training pre-flight before the first step. (The draws themselves, on the rank pool:
tests/ranks/test_random_draws.py.)"""

import pytest

from train_helpers import launch, max_rel_diff, prepare, weights

COMMON = ["--config-name", "quickstart", "train.global_batch_size=2", "train.max_steps=3", "train.seed=5",
          "train.eval_every=0", "train.eval_at_end=false", "optim.lr=0.05", "sched.warmup_epochs=0",
          "run.progress=false", "run.tensorboard=false", "run.log_every=1"]



@pytest.fixture(scope="module")
def cosmo_data(tmp_path_factory: pytest.TempPathFactory):
    return prepare("cosmoflow", tmp_path_factory.mktemp("cosmo16_random"), 16, 4, 2)



def test_training_with_stochastic_depth_at_2x1x1_ends_with_the_serial_weights(cosmo_data, tmp_path):
    # float64: the runs may differ only in summation order (float32 rounding alone moves the
    # biases by ~1e-5 relative, more on NDHWC kernels), and a wrong draw moves them by O(1).
    # parallel.verify=auto must still check a float64 model (its dry runs once probed in float32)
    model = ["model._target_=tests.support.random_models.StochasticDepthNet", "model.drop=0.5", "train.precision=fp64"]
    runs = {}
    for label, nproc, spatial in [("serial", 1, "[1,1,1]"), ("split", 2, "[2,1,1]")]:
        run_dir = tmp_path / label
        proc = launch("cosmoflow", nproc, [*COMMON, *model, f"data.dir={cosmo_data}", f"run.dir={run_dir}",
                                           f"parallel.spatial={spatial}"])
        runs[label] = weights(run_dir)
        if label == "split":
            assert "parallel.verify: checked before the first step" in proc.stdout + proc.stderr
    diff, key = max_rel_diff(runs["serial"], runs["split"])
    assert diff < 1e-9, f"{key} differs by {diff:.2e} relative between the serial and the split run"



def test_training_with_volume_noise_is_stopped_before_the_first_step(cosmo_data, tmp_path):
    # on the job pool's ranks: the refusal is the loop's, whatever launched it
    proc = launch("cosmoflow", 2, [*COMMON, "model._target_=tests.support.random_models.NoisyNet",
                                   f"data.dir={cosmo_data}", f"run.dir={tmp_path / 'run'}", "parallel.spatial=[2,1,1]"],
                  check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]  # an input error, every rank alike
    assert "in the forward of 'jitter' (Jitter) draws random numbers shaped like the volume" in text, text[-3000:]
    assert "parallel.spatial=[2, 1, 1] splits" in text, text[-3000:]
    assert not (tmp_path / "run" / "checkpoints" / "last.pt").exists()
