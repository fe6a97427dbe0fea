"""Block bounds and window segments (``parallel/partition.py``): blocks that differ by at
most one voxel, halos trimmed or filled at the volume's edge or wrapped around it, and
errors that name the dim and the numbers."""

import pytest

from parallel.grid import Grid
from parallel.partition import Segment, SplitError, block_bounds, owner_of, window_segments


@pytest.mark.parametrize("n,parts,sizes", [(19, 3, [7, 6, 6]), (18, 3, [6, 6, 6]), (8, 4, [2, 2, 2, 2]),
                                           (5, 2, [3, 2]), (7, 1, [7])])
def test_blocks_differ_by_at_most_one_and_lower_ranks_take_more(n, parts, sizes):
    bounds = block_bounds(n, parts)
    assert [b - a for a, b in bounds] == sizes
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(parts - 1))
    assert all(owner_of(i, n, parts) == p for p, (a, b) in enumerate(bounds) for i in range(a, b))


def test_more_blocks_than_voxels_is_an_error_with_the_numbers():
    with pytest.raises(SplitError, match="size 3 cannot be split 4 ways"):
        block_bounds(3, 4)


def test_window_with_halo_trim_and_constant_fill():
    # 10 split 2 = [0,5) [5,10); window [-2, 7) on position 0 reads fill, own block, 2 of the next
    segs = window_segments(-2, 7, 10, 2, "constant")
    assert segs == [Segment(None, 0, 0, 2), Segment(0, 0, 2, 5), Segment(1, 0, 7, 2)]
    # a strided layer's trimmed window: [6, 9) lies inside block 1 only
    assert window_segments(6, 9, 10, 2, "constant") == [Segment(1, 1, 0, 3)]


def test_circular_window_wraps_around_the_volume():
    segs = window_segments(-1, 6, 10, 2, "circular")
    assert segs == [Segment(1, 4, 0, 1), Segment(0, 0, 1, 5), Segment(1, 0, 6, 1)]
    # wider than the whole volume: the same voxels appear twice
    assert sum(s.length for s in window_segments(-6, 8, 4, 2, "circular")) == 14


def test_block_range_error_names_the_dim():
    g = Grid(spatial=(1, 4, 1), world_size=4, rank=0)
    with pytest.raises(SplitError, match="dim H has 3 voxels for 4 blocks"):
        g.block_range((8, 3, 8))
