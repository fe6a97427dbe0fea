"""Training crops: the reference's RandBalancedCrop without reading the label, each rank's
block of an edge-padded crop, whole cases of different shapes kept apart, and what an
unfiltered chunk costs. (What each rank reads on real ranks:
tests/ranks/test_data_crops_share.py.)"""

import math

import h5py
import numpy as np
import pytest
import torch

import crop_cases
from parallel.data import BlockDataset, GlobalShuffleSampler, make_loader
from parallel.data.crops import REGION_KEY, BalancedCrop, FixedRegion, balanced_crop, crop_rng
from parallel.data.foreground import foreground_boxes
from parallel.data.loader import BatchShapeError
from parallel.grid import Grid


@pytest.mark.parametrize("shape,patch", [((40, 36, 30), (16, 16, 16)), ((20, 12, 30), (24, 16, 16)),
                                         ((9, 10, 8), (16, 16, 16))], ids=["larger", "mixed", "smaller"])
def test_crops_from_stored_boxes_equal_crops_from_the_label(shape, patch):
    """Same seed, same draws: the boxes give exactly the crop the label map gives,
    edge padding of cases smaller than the crop included."""
    kinds = {True: 0, False: 0}
    for case in range(40):
        label = crop_cases.blobs(shape, case, touch_border=True)
        boxes = foreground_boxes(label, 3)
        for draw in range(5):
            region, fg = balanced_crop(shape, patch, boxes, 0.4, crop_rng(case, draw, 0))
            assert region.start == crop_cases.reference_crop(label, patch, 0.4, crop_rng(case, draw, 0))
            assert region.size == tuple(patch)
            kinds[fg] += 1
    assert kinds[True] > 40 and kinds[False] > 80  # both kinds were exercised (p = 0.4)


def test_foreground_crops_hold_the_chosen_component():
    label = np.zeros((64, 64, 64), np.uint8)
    label[40:44, 5:9, 50:53] = 2  # a small tumour far from the centre
    boxes = foreground_boxes(label, 3)
    for i in range(50):
        region, fg = balanced_crop(label.shape, (32,) * 3, boxes, 1.0, crop_rng(0, 0, i))
        assert fg
        box = tuple(slice(s, s + n) for s, n in zip(region.start, region.size))
        assert (label[box] == 2).sum() == 4 * 4 * 3  # the whole component lies inside the crop
        assert all(0 <= s and s + n <= 64 for s, n in zip(region.start, region.size))


@pytest.mark.parametrize("start", [(3, 5, 2), (-4, 10, -7), (-10, -3, -20)], ids=["inside", "edges", "beyond"])
@pytest.mark.parametrize("spatial", [(1, 1, 1), (2, 1, 1), (2, 2, 1)], ids=lambda s: "x".join(map(str, s)))
def test_each_rank_reads_its_block_of_the_edge_padded_crop(tmp_path, start, spatial):
    path, image, label = crop_cases.case_file(tmp_path, "c.h5", (18, 22, 14), crop=(16, 16, 16), codec="zstd")
    size = (16, 16, 30)
    pad = [(max(0, -s), max(0, s + n - m)) for s, n, m in zip(start, size, image.shape[1:])]
    full_x = np.pad(image, [(0, 0)] + pad, mode="edge")
    full_y = np.pad(label, pad, mode="edge")
    box = tuple(slice(s + a, s + a + n) for s, (a, _), n in zip(start, pad, size))
    for rank in range(math.prod(spatial)):
        grid = Grid(spatial=spatial, world_size=math.prod(spatial), rank=rank)
        sample = BlockDataset([path], grid=grid, regions=FixedRegion(start, size))[0]
        mine = grid.block_slices(size)
        np.testing.assert_array_equal(sample["image"].numpy(), full_x[(slice(None),) + box][(slice(None),) + mine])
        np.testing.assert_array_equal(sample["label"].numpy(), full_y[box][mine])
        assert sample[REGION_KEY].tolist() == [*start, *size]


def test_loader_draws_each_epochs_crops(tmp_path):
    files = [crop_cases.case_file(tmp_path, f"case_{i}.h5", (30, 26, 28), seed=i)[0] for i in range(4)]
    grid = Grid(spatial=(2, 1, 1), world_size=2, rank=1)
    ds = BlockDataset(files, fields=("image", "label"), grid=grid, regions=BalancedCrop((16, 16, 16), 0.4, seed=3))
    sampler = GlobalShuffleSampler(4, grid, global_batch=2, seed=5)
    loader = make_loader(ds, sampler, num_workers=1)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        for (batch, _), indices in zip(loader, list(sampler)):
            assert batch["image"].shape == (2, 1, 8, 16, 16) and batch["label"].shape == (2, 8, 16, 16)
            for row, i in enumerate(indices):
                with h5py.File(files[i], "r") as f:
                    boxes, shape = f["fg_boxes"][0], tuple(f.attrs["global_shape"])
                region, _ = balanced_crop(shape, (16, 16, 16), boxes, 0.4, crop_rng(3, epoch, i))
                assert batch[REGION_KEY][row].tolist() == [*region.start, *region.size]


def test_whole_cases_of_different_shapes_are_not_stacked(tmp_path):
    files = [crop_cases.case_file(tmp_path, f"case_{i}.h5", shape, seed=i)[0] for i, shape in enumerate([(8, 10, 12), (8, 10, 14)])]
    grid = Grid(spatial=(1, 1, 1), world_size=1, rank=0)
    ds = BlockDataset(files, fields=("image", "label"), grid=grid)
    with pytest.raises(BatchShapeError, match=r"case_0\.h5\[0\] \(1, 8, 10, 12\), case_1\.h5\[0\] \(1, 8, 10, 14\)"):
        list(make_loader(ds, GlobalShuffleSampler(2, grid, 2, shuffle=False), num_workers=0))
    one = list(make_loader(ds, GlobalShuffleSampler(2, grid, 1, shuffle=False), num_workers=0))
    assert [b["image"].shape[2:] for b, _ in one] == [torch.Size([8, 10, 12]), torch.Size([8, 10, 14])]


def test_reading_an_unfiltered_chunk_costs_only_the_selection(tmp_path):
    """The reader's estimate for uncompressed data (selected voxels) is what HDF5 reads."""
    path, _, _ = crop_cases.case_file(tmp_path, "u.h5", (64, 64, 64), crop=(64, 64, 64))
    grid = Grid(spatial=(2, 1, 1), world_size=2, rank=1)
    native = BlockDataset([path], fields=("image", "label"), grid=grid, regions=FixedRegion((5, 9, 3), (32, 40, 48)))
    counting = BlockDataset([path], fields=("image", "label"), grid=grid, io="counting", regions=FixedRegion((5, 9, 3), (32, 40, 48)))
    native.load(0), counting.load(0)  # open the files: headers are not the point here
    est, real = native.load(0)[1], counting.load(0)[1]
    want = 16 * 40 * 48 * 5
    assert est == want and want <= real <= 1.05 * want, (est, real)
