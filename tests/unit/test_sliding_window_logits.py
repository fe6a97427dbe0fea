"""Sliding-window inference of a pointwise model returns its logits at every voxel: the
window weighting, uneven tiling and padding of windows larger than the case, as the
MLPerf reference pads (``parallel/infer``). (Predictions at every grid:
tests/launch/test_predict.py.)"""

import pytest
import torch
from torch import nn


@pytest.mark.parametrize("shape, window", [((20, 24, 28), 16), ((20, 12, 9), 16), ((16, 16, 16), 32),
                                           ((5, 40, 16), 8)])
def test_sliding_window_of_a_pointwise_model_is_its_logits(shape, window):
    # A 1x1x1 conv sees no context, so every window gives each voxel the same logits: the
    # weighted average over windows must reproduce them at every voxel of the case (uneven
    # tiling, windows larger than the case: padded, centred, as the reference pads)
    from parallel.data.crops import Region
    from parallel.infer import case_logits

    torch.manual_seed(0)
    model = nn.Conv3d(2, 3, 1).double()
    x = torch.randn(1, 2, *shape, dtype=torch.float64)
    with torch.no_grad():
        expect = model(x)
    region = Region((0, 0, 0), shape).as_tensor()
    got = case_logits(model, x, None, mode="sliding", region=region, window=(window,) * 3)
    assert got.shape == expect.shape
    torch.testing.assert_close(got, expect, rtol=1e-12, atol=1e-12)
