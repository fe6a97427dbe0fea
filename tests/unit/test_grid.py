"""The grid (``parallel/grid.py``): each rank's coordinates, neighbours and block, and a
world the split does not divide refused with the numbers."""

import pytest

from parallel.grid import Grid


def test_grid_coordinates_neighbours_and_blocks():
    g = Grid(spatial=(3, 1, 2), world_size=12, rank=7)
    assert (g.data_size, g.data_rank, g.spatial_rank, g.coords) == (2, 1, 1, (0, 0, 1))
    assert g.line_ranks(2) == [7, 9, 11]
    assert g.neighbors(2) == (None, 9)
    assert g.neighbors(2, periodic=True) == (11, 9)
    assert g.neighbors(4) == (6, None)
    assert g.block_range((19, 5, 8)) == ((0, 7), (0, 5), (4, 8))
    assert g.batch_range(5) == (3, 5)
    assert g.rank_at((2, 0, 1)) == 11


def test_grid_refuses_a_world_the_split_does_not_divide():
    with pytest.raises(ValueError, match=r"world size 6 is not a multiple of the spatial group size 2x2x1 = 4"):
        Grid(spatial=(2, 2, 1), world_size=6, rank=0)
    with pytest.raises(ValueError, match="three positive ints"):
        Grid(spatial=(2, 0, 1), world_size=2, rank=0)
