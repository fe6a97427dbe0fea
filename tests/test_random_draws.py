"""Random draws in a network's forward under a spatial split.

The ranks of a spatial group draw from the serial run's global stream, so a draw per
sample (stochastic depth: MONAI EfficientNet-B0's ``drop_connect``, a ``torch.rand`` of
shape (N, 1, 1, 1, 1)) equals the serial run's: through ``parallelize`` with verification
(which leaves the stream where it was) and through the training loop (seeded per data
group, no longer per rank). A draw shaped like the volume cannot equal it, and is stopped
by name: by ``parallel.verify`` (the split model's draws against the serial model's) and
by the training pre-flight (a trace on the meta device).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import host_cases
from parallel.model.random_draws import check_model, stream_seed
from tests.random_models import NoisyNet, StochasticDepthNet
from train_helpers import BIN, REPO, env, launch, max_rel_diff, prepare, weights

D2 = (2, 1, 1)


def test_a_per_sample_draw_passes_the_preflight_and_volume_noise_is_named():
    draws = check_model(StochasticDepthNet(), (4, 16, 16, 16), D2)
    assert [d.shape for d in draws] == [(1, 1, 1, 1, 1)] * 3 and {d.module for d in draws} == {
        "blocks.0.drop", "blocks.1.drop", "blocks.2.drop"}
    with pytest.raises(ValueError, match=r"randn_like of shape \[1, 4, 16, 16, 16\] in the forward of 'jitter' "
                                         r"\(Jitter\) draws random numbers shaped like the volume"):
        check_model(NoisyNet(), (4, 16, 16, 16), D2)
    assert check_model(NoisyNet(), (4, 16, 16, 16), (1, 1, 1)) == []  # nothing split: nothing to refuse


def test_noise_after_a_global_pool_and_dropout_modules_pass_the_preflight():
    class PooledNoise(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.pool = torch.nn.Conv3d(4, 4, 3, padding=1), torch.nn.AdaptiveAvgPool3d(1)
            self.drop = torch.nn.Dropout(0.5)  # converted to per-block streams by parallelize

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.pool(self.drop(self.conv(x)))
            return (y + torch.randn_like(y)).flatten(1)  # whole on every rank: the serial draw

    draws = check_model(PooledNoise(), (4, 8, 8, 8), D2)
    assert [d.shape for d in draws] == [(1, 4, 1, 1, 1)]


def test_efficientnet_b0_with_stochastic_depth_equals_serial_at_2x1x1(pools):
    # B0 downsamples 32 times, so a 2-way split along D needs 64; 32 is the smallest H and W
    # its 5x5x5 kernels take. Verification (float64, with gradients) raises where it differs.
    results = pools.run(2, host_cases.efficientnet_stochastic_depth, (1, 1, 64, 32, 32), spatial=D2, timeout=600)
    for r in results:
        assert r["split"] < 1e-9, r  # float64 sums in another order
        assert r["another_seed"] > 1e-3, r  # the draws matter: another seed, another output


def test_volume_noise_is_stopped_by_verify_naming_the_module(pools):
    message = pools.run(2, host_cases.noise_is_stopped_by_verify, spatial=D2)[0]
    assert "randn_like of shape [1, 4, 4, 8, 8] in the forward of 'jitter' (Jitter)" in message, message
    assert "is shaped like the split volume (the serial model draws [1, 4, 8, 8, 8])" in message, message


def test_the_stream_seed_is_the_serial_runs_for_data_group_0():
    assert stream_seed(5, 0) == 5 + 7919 and stream_seed(5, 1) != stream_seed(5, 0)


COMMON = ["--config-name", "quickstart", "train.global_batch_size=2", "train.max_steps=3", "train.seed=5",
          "train.eval_every=0", "train.eval_at_end=false", "optim.lr=0.05", "sched.warmup_epochs=0",
          "run.progress=false", "run.tensorboard=false", "run.log_every=1"]


@pytest.fixture(scope="module")
def cosmo_data(tmp_path_factory: pytest.TempPathFactory):
    return prepare("cosmoflow", tmp_path_factory.mktemp("cosmo16_random"), 16, 4, 2)


@pytest.mark.launch
def test_training_with_stochastic_depth_at_2x1x1_ends_with_the_serial_weights(cosmo_data, tmp_path):
    # float64: the runs may differ only in summation order (float32 rounding alone moves the
    # biases by ~1e-5 relative, more on NDHWC kernels), and a wrong draw moves them by O(1).
    # parallel.verify=auto must still check a float64 model (its dry runs once probed in float32)
    model = ["model._target_=tests.random_models.StochasticDepthNet", "model.drop=0.5", "train.precision=fp64"]
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


@pytest.mark.launch
def test_training_with_volume_noise_is_stopped_before_the_first_step(cosmo_data, tmp_path):
    cmd = [str(BIN / "mpirun"), "-n", "2", sys.executable, "-m", "cosmoflow.train", *COMMON, "model._target_=tests.random_models.NoisyNet", f"data.dir={cosmo_data}",
           f"run.dir={tmp_path / 'run'}", "parallel.spatial=[2,1,1]"]
    proc = subprocess.run(cmd, env=env(), cwd=REPO, timeout=240, capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]  # an input error, every rank alike
    assert "in the forward of 'jitter' (Jitter) draws random numbers shaped like the volume" in text, text[-3000:]
    assert "parallel.spatial=[2, 1, 1] splits" in text, text[-3000:]
    assert not (tmp_path / "run" / "checkpoints" / "last.pt").exists()
