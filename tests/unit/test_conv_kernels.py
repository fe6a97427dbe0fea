"""bfloat16 convolutions of thin blocks on CPUs: torch 2.13's CPU kernel returns a wrong
weight gradient when a spatial dim is shorter than the kernel's reach; the spatial layers'
kernels (``parallel.layers.conv.kernels``) and the shell conv must not inherit it."""

import pytest
import torch

from parallel.layers.conv.kernels import conv3d_backward


@pytest.mark.parametrize("shape", [(4, 8, 2, 4, 4), (2, 8, 4, 2, 4), (1, 8, 1, 5, 5)])
def test_bf16_backward_of_a_thin_block_equals_float32_to_bf16_rounding(shape):
    torch.manual_seed(0)
    x, w = torch.randn(shape), torch.randn(16, 8, 3, 3, 3) * 0.1
    g = torch.randn(shape[0], 16, *shape[2:])  # padding 1 keeps the size
    ref = conv3d_backward(g, x, w, (1, 1, 1), (1, 1, 1), (1, 1, 1), 1, (True, True))
    low = conv3d_backward(g.bfloat16(), x.bfloat16(), w.bfloat16(), (1, 1, 1), (1, 1, 1), (1, 1, 1), 1, (True, True))
    for name, a, b in zip(("input", "weight"), low, ref):
        assert a.dtype == torch.bfloat16
        err = float((a.float() - b).abs().max() / b.abs().max())
        assert err < 2e-2, f"{name} gradient of a {shape} block off by {err:.3g} relative"


def test_the_selfcheck_network_in_bf16_on_one_rank_is_within_its_tolerance():
    from parallel.grid import Grid
    from parallel.verify.selfcheck import TOLERANCE, run

    report = run(Grid(spatial=(1, 1, 1), world_size=1, rank=0), precision="bf16")
    assert report["max_rel_diff"] <= TOLERANCE["bf16"] / 4, report
