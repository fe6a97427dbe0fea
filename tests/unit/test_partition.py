"""Pure logic: block bounds, window segments, grid geometry, launcher detection."""

import pytest

from parallel.grid import Grid
from parallel.partition import Segment, SplitError, block_bounds, owner_of, window_segments
from parallel.runtime.launch import detect_launcher, first_slurm_host


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


def test_block_range_error_names_the_dim():
    g = Grid(spatial=(1, 4, 1), world_size=4, rank=0)
    with pytest.raises(SplitError, match="dim H has 3 voxels for 4 blocks"):
        g.block_range((8, 3, 8))


@pytest.mark.parametrize("env,expected", [
    ({}, "single"),
    ({"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "torchrun"),
    ({"PMI_RANK": "1", "PMI_SIZE": "4"}, "mpi"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "mpi"),
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "8"}, "slurm"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, "single"),
])
def test_launcher_detection(env, expected):
    assert detect_launcher(env) == expected


@pytest.mark.parametrize("nodelist,host", [("gpu[012-015,020]", "gpu012"), ("cn7,cn9", "cn7"),
                                           ("node[3,5]", "node3"), ("login", "login")])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host
