"""The gradient noise scale: the data groups' gradients the hierarchical sync forms, against
each group's gradient by the serial model (fp64), and the step's weights unchanged by it."""

import pytest

import noise_cases


@pytest.mark.parametrize("world,spatial,accum,collectives", [(4, (2, 1, 1), 1, False), (4, (1, 1, 1), 2, False),
                                                             (4, (2, 1, 1), 1, True)],
                         ids=["data2-x-spatial2", "data4-accum2", "data2-x-spatial2-collectives"])
def test_logged_norms_equal_each_groups_gradient_and_weights_stay(pools, world, spatial, accum, collectives):
    """``collectives``: the reduce-scatter and all-gather as NCCL runs them (the backend's
    collectives; gloo has both), which no GPU has run yet."""
    worst = pools.run(world, noise_cases.logged_norms_against_groups, accum, 2, collectives, spatial=spatial)[0]
    assert worst["small"] < 1e-9 and worst["big"] < 1e-9, worst


def test_reduce_scatter_and_all_gather_over_four_ranks(pools):
    pools.run(4, noise_cases.scatter_and_gather, spatial=(2, 2, 1))


def test_the_step_benchmark_times_both_syncs_at_data2_x_spatial2(pools):
    from parallel.bench.step import sync_times

    r = pools.run(4, sync_times, "cosmoflow", (8, 8, 8), ["model.n_conv_blocks=2", "model.conv_filters=4"], 2, 1,
                  spatial=(2, 1, 1))[0]
    assert set(r["seconds"]) == {"flat", "hierarchical", "flat_again"} and r["hierarchical_over_flat"] > 0
