"""The overlapped halo exchange and per-block recomputation change no number.

The conv cases of tests/test_layers.py whose blocks all have an interior run again with
the overlap on (the layer tests run the default, blocking path, which is also what the
overlap falls back to for thinner blocks), against torch.nn, and must have taken the
overlapped path. Recomputation is compared with none.
"""

import math

import pytest

import overlap_cases
from test_layers import CONV

OVERLAPPED = [c for c in CONV if c[0] in {
    "k3-pad1-D2", "k5-pad2-H3-uneven19", "k3-stride2-pad1-H3-uneven19", "k3-same-H3", "k3-circular-D2",
    "k3-groups2-nobias-D2", "k3-corners-1x2x2", "k3-dilation2-pad2-D2", "k3-pad1-D2-thin-reordered",
    "k313-stride121-D2-thin-reordered"}]


@pytest.mark.parametrize("case_id,build,shape,spatial", OVERLAPPED, ids=[c[0] for c in OVERLAPPED])
def test_overlapped_conv_equals_serial(pools, case_id, build, shape, spatial):
    results = pools.run(math.prod(spatial), overlap_cases.conv_overlapped, build, shape, spatial=spatial)
    assert all(r["overlap_taken"] for r in results), f"{case_id}: the overlapped path was not taken"


@pytest.mark.parametrize("spatial,world", [((1, 1, 1), 1), ((1, 2, 1), 4)], ids=["serial", "data2-spatial2"])
def test_recompute_equals_no_recompute_with_dropout_and_batchnorm(pools, spatial, world):
    pools.run(world, overlap_cases.recompute_equals_plain, 0.3, True, spatial=spatial)


def test_unet_blocks_recomputed_equal_serial(pools):
    counts = pools.run(2, overlap_cases.unet_recompute_blocks, spatial=(2, 1, 1))
    assert counts[0] == 2 + 2 * 2 + 2  # input block's 2 conv blocks, 2 per level down, 2 up blocks
