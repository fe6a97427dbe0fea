"""Random draws in a network's forward under a spatial split, on the rank pool.

The ranks of a spatial group draw from the serial run's global stream, so a draw per
sample (stochastic depth: MONAI EfficientNet-B0's ``drop_connect``, a ``torch.rand`` of
shape (N, 1, 1, 1, 1)) equals the serial run's through ``parallelize`` with verification
(which leaves the stream where it was). A draw shaped like the volume cannot equal it,
and is stopped by name: by ``parallel.verify`` (the split model's draws against the
serial model's) and by the pre-flight (a trace on the meta device). (Through the training
loop: tests/launch/test_random_draws_training.py.)"""

import pytest
import torch

import host_cases
from parallel.model.random_draws import check_model, stream_seed
from random_models import NoisyNet, StochasticDepthNet

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
