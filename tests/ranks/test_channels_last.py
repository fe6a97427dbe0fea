"""channels-last (NDHWC, ``parallelize(..., channels_last=True)``): the same numbers as the
default NCDHW path for every kind of layer, NDHWC from layer to layer, scatter and gather
keeping the layout. (The training loop: tests/launch/test_channels_last_training.py.)"""

import math

import pytest

import layout_cases

CASES = [("conv_pool_linear", (2, 1, 1)), ("conv_pool_linear", (1, 2, 2)), ("norms_transposed", (1, 1, 2)),
         ("global_pool", (2, 1, 1))]



@pytest.mark.parametrize("name,spatial", CASES, ids=["cosmo-D2", "cosmo-H2xW2", "unet-W2", "globalpool-D2"])
def test_channels_last_equals_the_default_path(pools, name, spatial):
    results = pools.run(math.prod(spatial), layout_cases.equals_default, name, spatial=spatial,
                        timeout=300)  # a loaded 2-core machine: ~35 s measured under load 145
    assert all(r["convs"] >= 2 for r in results), results



def test_scatter_and_gather_keep_the_layout(pools):
    for r in pools.run(2, layout_cases.scatter_keeps_layout, spatial=(1, 2, 1)):
        assert all(r), r
