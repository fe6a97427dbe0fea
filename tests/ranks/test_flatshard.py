"""Flatten+Linear weights sharded by block: each rank keeps its columns (weight, gradient,
optimiser state), the numbers equal the serial model's (float64, several grids), and the
state holds the serial tensors, gathered on save and cut on load at any grid."""

import math

import pytest

import shard_cases

SHAPE, UNEVEN = shard_cases.SHAPE, (2, 4, 3, 7)   # without the pool, W = 7 splits 3 ways as 3, 2, 2
GRIDS = [((2, 1, 1), 1, SHAPE, True), ((1, 2, 2), 1, SHAPE, True), ((2, 1, 1), 2, SHAPE, True),
         ((1, 1, 3), 1, UNEVEN, False)]


@pytest.mark.parametrize("spatial,data,shape,pool", GRIDS, ids=["D2", "H2xW2", "D2-data2", "W3-uneven"])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_sharded_training_equals_serial(pools, spatial, data, shape, pool, optim):
    world = math.prod(spatial) * data
    results = pools.run(world, shard_cases.training_equals_serial, optim, shape, pool, spatial=spatial)
    split = math.prod(spatial)
    for r in results:
        # the weight and the optimiser's per-element state per rank: about 1/split of the columns
        assert r["weight"] == [5, r["columns"]]
        assert all(s == r["weight"] for s in r["grad_or_state"]) and r["grad_or_state"], r
        assert r["columns"] <= math.ceil(r["in_features"] / split * 1.5)
    assert sum(r["columns"] for r in results[:split]) == results[0]["in_features"]


@pytest.mark.parametrize("spatial,data,optim,meta", [((2, 1, 1), 1, "sgd", True), ((2, 1, 1), 2, "adamw", True),
                                                     ((2, 1, 1), 1, "sgd", False)],
                         ids=["D2-sgd", "D2-data2-adamw", "D2-sgd-no-meta-copy"])
def test_sharded_at_the_first_forward_without_input_shape(pools, spatial, data, optim, meta):
    """No input_shape: the weight is sharded at the first forward, after the optimiser was
    built on the whole parameter, before the first layer runs (or, for a model that cannot
    be copied to the meta device, when the forward reaches the Linear), and training still
    equals the serial model's."""
    world = math.prod(spatial) * data
    results = pools.run(world, shard_cases.training_equals_serial, optim, SHAPE, True, 2, True, meta,
                        spatial=spatial)
    for r in results:
        assert r["weight"] == [5, r["columns"]] and r["columns"] < r["in_features"], r
        assert all(s == r["weight"] for s in r["grad_or_state"]) and r["grad_or_state"], r
    assert sum(r["columns"] for r in results[:math.prod(spatial)]) == results[0]["in_features"]


def test_whole_state_loaded_before_the_first_forward_is_cut(pools):
    pools.run(2, shard_cases.load_any_grid_state, True, spatial=(2, 1, 1))


@pytest.mark.parametrize("spatial", [(2, 1, 1), (1, 2, 2)], ids=["D2", "H2xW2"])
def test_whole_state_loads_as_the_shard_and_trains_on_equal(pools, spatial):
    pools.run(math.prod(spatial), shard_cases.load_any_grid_state, spatial=spatial)


def test_kfac_leaves_a_sharded_linear_to_the_plain_update(pools):
    logged = pools.run(2, shard_cases.kfac_leaves_the_shard, spatial=(2, 1, 1))
    assert any("sharded by block" in line for line in logged[0]), logged[0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("spatial", [(2, 1, 1), (2, 2, 1)], ids=["D2", "D2xH2"])
def test_low_precision_output_and_gradients_are_as_close_to_exact_as_the_serial_layers(pools, spatial, dtype):
    """Under autocast the sharded Flatten+Linear forms its partial products in float32, sums
    them across ranks in float32 and rounds once, as the serial layer rounds its float32
    accumulation once: its output and gradients are as close to the exact result of the
    rounded inputs as the serial layer's (summed in low precision, rank by rank, they were not)."""
    results = pools.run(math.prod(spatial), shard_cases.low_precision_like_serial, dtype, spatial=spatial)
    for r in results:
        for what, serial in r["serial"].items():
            # one rounding of the output (2^-8 relative in bf16) or of a gradient, not one per rank
            assert r["split"][what] <= 1.5 * serial + 1e-7, (what, r)
        assert r["dtypes"] == [f"torch.{dtype}"] * 2, r  # rounded once, to autocast's dtype, as the serial layer
