"""K-FAC at spatial x data grids equals the plain serial K-FAC (float64), on real gloo ranks:
steps, distributed eigendecompositions, and a state saved at one grid resumed at another."""

import pytest

import kfac_cases

# (id, world size, spatial split)
GRIDS = [
    ("spatial-2x1x1", 2, (2, 1, 1)),
    ("data2-spatial-1x1x1", 2, (1, 1, 1)),
    ("spatial-2x2x1", 4, (2, 2, 1)),
    ("data2-spatial-2x1x1", 4, (2, 1, 1)),
]


@pytest.mark.parametrize("world,spatial", [g[1:] for g in GRIDS], ids=[g[0] for g in GRIDS])
def test_kfac_steps_equal_serial(pools, world, spatial):
    # 5 steps: factors every step (running averages), eigendecompositions at steps 0, 2, 4
    # (steps 1 and 3 reuse them), the KL clip active.
    results = pools.run(world, kfac_cases.check_steps, 5, kfac_cases.settings(), spatial=spatial, timeout=300)
    for r in results:
        assert len(r["layers"]) == 7 and r["moved"] > 1e-3
        assert min(r["nus"]) < 1.0  # the KL clip took part
    assert all(r["nus"] == results[0]["nus"] for r in results)


def test_kfac_unet_like_voxel_output_equals_serial(pools):
    # A loss over voxels (spatial sums, no replicated output), k2 s2 down and up, 'same' k4.
    results = pools.run(4, kfac_cases.check_steps, 4, kfac_cases.settings(), (), 0, "unet", spatial=(2, 2, 1),
                        timeout=300)
    assert len(results[0]["layers"]) == 5 and results[0]["moved"] > 1e-3


def test_kfac_with_overlapped_halo_equals_serial(pools):
    # Factor steps (even) take the plain path for the window; odd steps run overlapped.
    kw = kfac_cases.settings(factor_interval=2, inverse_interval=2)
    pools.run(2, kfac_cases.check_steps, 4, kw, (), 0, "main", True, spatial=(2, 1, 1), timeout=300)


@pytest.mark.parametrize("kw", [kfac_cases.settings(), kfac_cases.settings(max_factor_dim=20, rank=12, oversample=4)],
                         ids=["dense", "low-rank"])
def test_costs_count_the_bytes_a_step_reduces_and_broadcasts(pools, kw):
    for r in pools.run(4, kfac_cases.measured_traffic, kw, spatial=(2, 1, 1), timeout=300):
        assert r["world"] == r["costs_world"] > 0
        assert r["spatial"] == r["costs_spatial"] > 0
        assert r["broadcast"] == r["costs_broadcast"] > 0


def test_kfac_intervals_and_exclusion_equal_serial(pools):
    # Factors every 2nd step, eigendecompositions every 4th; the Flatten+Linear excluded
    # (plain update) while its neighbours are preconditioned.
    kw = kfac_cases.settings(factor_interval=2, inverse_interval=4)
    results = pools.run(4, kfac_cases.check_steps, 6, kw, ("11",), spatial=(2, 2, 1), timeout=300)
    assert "11" not in results[0]["layers"] and len(results[0]["layers"]) == 6


def test_kfac_resume_at_another_grid(pools):
    kw = kfac_cases.settings()
    # 3 steps at spatial 2x1x1 (eigendecompositions at steps 0 and 2), then resume at data 2 x
    # spatial 2x1x1: step 3 must use the loaded eigendecompositions, step 4 new ones.
    saved = pools.run(2, kfac_cases.run_and_save, 3, kw, spatial=(2, 1, 1), timeout=300)[0]
    worst = pools.run(4, kfac_cases.resume_and_check, saved, 3, 6, kw, spatial=(2, 1, 1), timeout=300)
    assert max(worst) <= kfac_cases.RTOL


def test_eigendecompositions_spread_over_ranks_equal_local(pools):
    dims = [40, 7, 33, 12, 5, 21]
    owners = pools.run(4, kfac_cases.decompose_matches, dims, spatial=(2, 2, 1), timeout=120)
    # Longest first to the least loaded: 40^3 -> 0, 33^3 -> 1, 21^3 -> 2, then 12^3, 7^3, 5^3 -> 3.
    assert all(o == [0, 3, 1, 3, 3, 2] for o in owners)


LOW_RANK_GRIDS = [("spatial-2x1x1", 2, (2, 1, 1)), ("spatial-2x2x1", 4, (2, 2, 1)), ("data2-spatial-2x1x1", 4, (2, 1, 1))]
# max_factor_dim 20 holds six of the seven layers' wide factor (A of the convolutions and of
# the Flatten+Linear, G of the transposed conv) at rank 12 of 55..193, sketched from the
# patches and rows of each rank's block; eigendecompositions at steps 0 and 2. The
# hierarchical form: the Flatten+Linear's A (193: 3 channels x 4^3 + bias) as the 2x2x1
# blocks of its input volume (48 features each) plus the bias, dense, and a rank-4 coupling;
# the blocks match (2x2x1) or refine (2x1x1) every grid's split, so the weight is sharded
# and each rank holds only its own blocks (parallel.kfac.local).
FORMS = {"diagonal": kfac_cases.settings(max_factor_dim=20, rank=12, oversample=4),
         "hierarchical": kfac_cases.settings(max_factor_dim=20, rank=4, oversample=4, flat_blocks=[2, 2, 1])}
PER_RANK = ("blocks_held", "blocks_local", "block_memory_bytes")  # the diagonal blocks a rank holds


@pytest.fixture(scope="module")
def low_rank_serial():
    return {form: kfac_cases.low_rank_serial(5, kw) for form, kw in FORMS.items()}


def _shared(report):
    return {name: {k: v for k, v in entry.items() if k not in PER_RANK} for name, entry in report.items()}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("world,spatial", [g[1:] for g in LOW_RANK_GRIDS], ids=[g[0] for g in LOW_RANK_GRIDS])
def test_low_rank_factors_equal_serial(pools, low_rank_serial, world, spatial, form):
    serial = low_rank_serial[form]
    assert len(serial["low_rank"]) == 6 and serial["low_rank"]["11"]["width"] == 193
    assert serial["low_rank"]["11"]["blocks"] == (5 if form == "hierarchical" else 0)
    results = pools.run(world, kfac_cases.check_low_rank_steps, 4, FORMS[form], serial, spatial=spatial, timeout=300)
    ranks = spatial[0] * spatial[1] * spatial[2]
    for r in results:
        assert _shared(r["low_rank"]) == _shared(serial["low_rank"]) and r["worst"] <= kfac_cases.RTOL
        if form == "hierarchical":  # the weight sharded, each rank its 4 / ranks blocks (and the bias')
            mine, whole = r["low_rank"]["11"], serial["low_rank"]["11"]
            assert r["sharded"] == ["11.weight"] and mine["blocks_local"] and not whole["blocks_local"]
            assert mine["blocks_held"] == 4 // ranks + 1 and whole["blocks_held"] == 5
            assert mine["block_memory_bytes"] < whole["block_memory_bytes"] / ranks * 1.01


def test_hierarchical_blocks_resume_at_another_grid(pools, low_rank_serial):
    # 3 steps at spatial 2x2x1 (each rank one block), saved as every grid keeps it (the blocks
    # gathered), resumed at data 2 x spatial 2x1x1 (each rank two blocks) and at spatial
    # 1x1x2, which the blocks do not refine (the weight whole, every block on every rank):
    # step 3 uses the loaded decompositions (of 12 rows' A: the blocks carry what rank 4
    # leaves), step 4 new ones of the loaded factors; both equal the uninterrupted serial run
    kw, serial = FORMS["hierarchical"], low_rank_serial["hierarchical"]
    saved = pools.run(4, kfac_cases.run_and_save, 3, kw, spatial=(2, 2, 1), timeout=300)[0]
    for world, spatial, local in ((4, (2, 1, 1), True), (2, (1, 1, 2), False)):
        for r in pools.run(world, kfac_cases.resume_low_rank, saved, 3, 5, kw, serial, spatial=spatial, timeout=300):
            assert r["worst"] <= kfac_cases.RTOL and r["sharded"] == (["11.weight"] if local else [])
            assert r["low_rank"]["11"]["blocks_local"] == local
            assert r["low_rank"]["11"]["blocks_held"] == (3 if local else 5)


def test_hierarchical_blocks_on_their_ranks_at_full_rank_equal_dense_kfac(pools):
    # Only the Flatten+Linear's A (193) above max_factor_dim, held hierarchically at rank >= its
    # width with each 2x2x1 block on its own rank: the steps are the plain dense reference's
    kw = kfac_cases.settings(max_factor_dim=192, rank=1000, oversample=0, flat_blocks=[2, 2, 1])
    results = pools.run(4, kfac_cases.check_steps, 2, kw, spatial=(2, 2, 1), timeout=300)
    assert len(results[0]["layers"]) == 7 and results[0]["moved"] > 1e-3 and results[0]["sharded"] == ["11.weight"]


def test_cheap_factor_updates_equal_serial(pools):
    # A convolution's A from the output positions at global multiples of 3 (blocks start at
    # 4 and at 2: not multiples), and the factor interval lengthened from the measured change
    # (1 -> 2 -> 4: updates at steps 0, 1, 2, none at 3): the serial run's choices, at 2x2x1.
    kw = kfac_cases.settings(position_stride=3, inverse_interval=4, stale_tol=10.0)
    serial = kfac_cases.low_rank_serial(4, kw)
    assert serial["staleness"]["interval"] == 4 and serial["staleness"]["updates"] == 3
    for r in pools.run(4, kfac_cases.check_low_rank_steps, 4, kw, serial, spatial=(2, 2, 1), timeout=300):
        assert r["worst"] <= kfac_cases.RTOL
        got, want = r["staleness"]["history"], serial["staleness"]["history"]
        assert [(s, i) for s, _, i in got] == [(s, i) for s, _, i in want] == [(1, 2), (2, 4)]
        assert max(abs(a[1] - b[1]) for a, b in zip(got, want)) < 1e-12


def test_staleness_of_blocks_held_on_their_ranks_is_the_serial_runs(pools):
    # A hierarchical A with its diagonal blocks on their ranks (2x2x1: each rank its own, their
    # running Grams differ rank by rank) and the factor interval moved by the measured change:
    # the change is the serial run's on every rank (the own blocks' squares summed over the
    # spatial group), so every rank moves the interval alike and the steps stay serial's
    kw = {**FORMS["hierarchical"], "inverse_interval": 4, "stale_tol": 10.0}
    serial = kfac_cases.low_rank_serial(4, kw)
    assert [(s, i) for s, _, i in serial["staleness"]["history"]] == [(1, 2), (2, 4)]
    for r in pools.run(4, kfac_cases.check_low_rank_steps, 4, kw, serial, spatial=(2, 2, 1), timeout=120):
        assert r["worst"] <= kfac_cases.RTOL and r["sharded"] == ["11.weight"]
        got, want = r["staleness"]["history"], serial["staleness"]["history"]
        assert [(s, i) for s, _, i in got] == [(s, i) for s, _, i in want]
        assert max(abs(a[1] - b[1]) for a, b in zip(got, want)) < 1e-12
