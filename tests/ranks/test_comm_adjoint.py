"""Adjoint (dot-product) tests of every communication primitive, on real gloo ranks:
<F x, y> == <x, F^T y>, with F^T the backward that autograd runs (DistDL's adjoint test).
The single-dim halo fetch/reduce pair is tested in tests/ranks/test_halo.py."""

import pytest

import comm_cases

GRIDS = [
    ("spatial2", 2, (2, 1, 1)),
    ("data2", 2, (1, 1, 1)),
    ("spatial3-uneven", 3, (1, 3, 1)),
    ("data2-spatial2", 4, (1, 2, 1)),
    ("spatial2x2", 4, (2, 1, 2)),
]


@pytest.mark.parametrize("world,spatial", [g[1:] for g in GRIDS], ids=[g[0] for g in GRIDS])
def test_adjoints(pools, world, spatial):
    for rank, errors in enumerate(pools.run(world, comm_cases.adjoints, spatial=spatial)):
        assert set(errors) == {"all_reduce_sum", "gather", "scatter", "spatial_sum", "replicated_grad",
                               "halo chain"}, rank
