"""The fit checks (``parallel.train.checks.fit``): a volume, a model's strides or a world
size the grid cannot split stops a job before training, naming the layer and the numbers."""

import pytest

from cosmoflow.family import FAMILY as COSMO
from cosmoflow.model import CosmoFlowConfig
from parallel.grid import Grid
from parallel.job.errors import InputError
from parallel.train.checks.fit import check_model
from sample_sets import SERIAL, fails, job_on, make_set


@pytest.fixture
def good(tmp_path):
    return make_set(tmp_path / "set")


def test_volume_the_grid_cannot_split(good):
    fails(job_on(good), r"parallel\.spatial=\[16, 1, 1\] cannot split the volume \[8, 8, 8\] .*train.*"
                        r"dim D has 8 voxels for 16 blocks", grid=Grid((16, 1, 1), 16, 0))


def test_model_strides_the_grid_cannot_split():
    cfg = CosmoFlowConfig(conv_filters=4, n_conv_blocks=3, dense_sizes=[16])
    check_model(COSMO, cfg, (16, 16, 16), 4, Grid((2, 2, 1), 4, 0))  # 16 -> 8 -> 4 -> 2: splits 2 ways
    with pytest.raises(InputError, match=r"layer '[\w.]+' \(MaxPool3d\): output size 2 along dim D \(input 4\) "
                                         r"cannot be split 4 ways for parallel\.spatial=\[4, 1, 1\]"):
        check_model(COSMO, cfg, (16, 16, 16), 4, Grid((4, 1, 1), 4, 0))


def test_norm_layers_left_with_one_voxel_and_kernels_beyond_the_volume():
    from torch import nn

    from parallel.job.family import model_config
    from unet3d.family import FAMILY as UNET

    deep = model_config(UNET)  # the MLPerf U-Net: 5 stride-2 levels take 32^3 to 1^3
    for grid in (SERIAL, Grid((2, 1, 1), 2, 0)):  # the README's split, and serially (torch fails there too)
        with pytest.raises(InputError, match=r"layer 'down\.4\.0\.1' \(InstanceNorm3d\) normalises each channel over "
                                             r"its 1x1x1 voxel\(s\) at a volume of \[32, 32, 32\]: instance norm needs "
                                             r"more than one"):
            check_model(UNET, deep, (32, 32, 32), 1, grid, local_batch=64 // grid.data_size)
    check_model(UNET, deep, (64, 64, 64), 1, SERIAL, local_batch=64)  # 2^3 at the bottleneck: fine
    batch = model_config(UNET, ["model.norm=batch"])
    check_model(UNET, batch, (32, 32, 32), 1, SERIAL, local_batch=2)  # 2 samples per rank
    with pytest.raises(InputError, match=r"\(BatchNorm3d\) normalises each channel over 1x1x1 voxel\(s\) x 1 "
                                         r"sample\(s\) per rank .* train\.global_batch_size"):
        check_model(UNET, batch, (32, 32, 32), 1, Grid((1, 1, 1), 2, 0), local_batch=1)  # 2 over 2 data groups

    class Wide(nn.Module):  # a kernel wider than what reaches it: torch's own check, named by layer
        def __init__(self) -> None:
            super().__init__()
            self.pool = nn.MaxPool3d(4)
            self.conv = nn.Conv3d(1, 2, 5)

        def forward(self, x):
            return self.conv(self.pool(x))

    from dataclasses import replace

    wide = replace(UNET, build_model=lambda cfg, volume: Wide())
    with pytest.raises(InputError, match=r"layer 'conv' \(Conv3d\) cannot take its input of 1x4x4x4 voxels .* at a "
                                         r"volume of \[16, 16, 16\]"):
        check_model(wide, None, (16, 16, 16), 1, SERIAL)


def test_world_size_the_grid_does_not_divide():
    with pytest.raises(ValueError, match=r"world size 3 is not a multiple of the spatial group size 2x1x1 = 2"):
        Grid((2, 1, 1), 3, 0)
