"""Halo exchange: the right window of the global tensor, and an exact adjoint."""

import pytest

import cases

# (id, world, split dim, global size, windows per block position, mode)
HALO_CASES = [
    ("halo1-D-split2", 2, 2, 10, [(-1, 6), (4, 11)], "constant"),
    ("halo2-H-split3-uneven", 3, 3, 19, [(-2, 9), (5, 15), (11, 21)], "constant"),
    ("trim-strided-W-split2", 2, 4, 11, [(0, 5), (5, 11)], "constant"),  # block 0 has 6, reads 5
    ("shifted-reads-neighbour-only", 2, 2, 10, [(5, 8), (0, 3)], "constant"),
    ("circular-D-split2", 2, 2, 8, [(-2, 6), (2, 10)], "circular"),
    ("circular-wider-than-volume-split4", 4, 4, 6, [(-7, 3), (-1, 4), (1, 9), (3, 13)], "circular"),
    ("halo-beyond-neighbour-split4", 4, 3, 9, [(-3, 6), (0, 9), (2, 8), (4, 12)], "constant"),
]


@pytest.mark.parametrize("world,dim,n,windows,mode", [c[1:] for c in HALO_CASES], ids=[c[0] for c in HALO_CASES])
def test_fetch_window_and_adjoint(pools, world, dim, n, windows, mode):
    spatial = [1, 1, 1]
    spatial[dim - 2] = world
    pools.run(world, cases.check_halo, n, dim, windows, mode, spatial=spatial)
