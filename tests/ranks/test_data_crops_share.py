"""Each rank reads only its share of each training crop: per rank and sample, the bytes
HDF5 pulls from the file stay within the crop's bytes over the spatial ranks plus one
chunk, and every grid draws the same crops. (The crops themselves:
tests/unit/test_data_crops.py.)"""

import math

import h5py

import crop_cases

GRIDS = [(2, [2, 1, 1]), (4, [2, 2, 1]), (4, [2, 1, 1]), (4, [1, 2, 2])]


def test_every_rank_reads_only_its_share_of_each_crop(pools, tmp_path):
    """Cases larger than the crop, uncompressed crop-chunked files: per rank and sample,
    bytes <= 1.1 x crop bytes / spatial ranks + one chunk (the reader's estimate and what
    HDF5 really pulled from the file), and every grid draws the same crops."""
    crop = (64, 64, 64)
    files = [str(crop_cases.case_file(tmp_path, f"case_{i}.h5", shape, crop=crop, seed=i)[0])
             for i, shape in enumerate([(90, 100, 96), (72, 110, 80), (100, 76, 120)])]
    with h5py.File(files[0], "r") as f:
        chunk = math.prod(f["image"].chunks) * 4
        assert f["image"].chunks == (1, 1, 16, 16, 32)  # unfiltered: edges up to half the smallest block
    crop_bytes = math.prod(crop) * (4 + 1)  # float32 image + uint8 label
    seen = None
    for world, spatial in GRIDS:
        s = math.prod(spatial)
        for io in ("native", "counting"):
            per_rank = pools.run(world, crop_cases.read_crops, files, crop, 3, io, spatial=spatial)
            regions = [[r[:3] for r in rank] for rank in per_rank]
            assert all(r == regions[0] for r in regions)  # every rank, every grid: the same crops
            seen = seen or regions[0]
            assert regions[0] == seen
            for rank in per_rank:
                for epoch, index, region, nbytes in rank[1:]:  # the first load also opened the file
                    assert nbytes <= 1.1 * crop_bytes / s + chunk, (spatial, io, epoch, index, nbytes)
    assert len({r for _, _, r in seen}) > 6  # the crops moved between samples and epochs
