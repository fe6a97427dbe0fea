"""Whole models: hybrid grids against serial, gradient accumulation, dropout, errors."""

import re
from functools import partial

import pytest
from torch import nn

import cases


@pytest.mark.parametrize("world,spatial", [(4, (2, 1, 1)), (4, (1, 2, 2)), (2, (1, 1, 1))],
                         ids=["data2-x-spatial2x1x1", "data1-x-spatial1x2x2", "data2-only"])
def test_every_layer_model_equals_serial(pools, world, spatial):
    reports = pools.run(world, cases.every_layer, str(spatial), spatial=spatial)
    assert reports[0]["data"] == world // (spatial[0] * spatial[1] * spatial[2])
    assert all(r["checksums"] == reports[0]["checksums"] for r in reports)  # gathered on every rank


@pytest.mark.parametrize("world,spatial", [(2, (2, 1, 1)), (4, (2, 1, 1))], ids=["spatial2", "data2-x-spatial2"])
def test_no_sync_accumulates_then_one_backward_syncs(pools, world, spatial):
    pools.run(world, cases.accumulate_then_sync, spatial=spatial)


@pytest.mark.parametrize("world,spatial", [(2, (2, 1, 1)), (2, (1, 1, 1)), (4, (1, 2, 1))])
def test_gradients_are_bucket_views_and_steps_equal_serial(pools, world, spatial):
    pools.run(world, cases.gradients_in_bucket_views, spatial=spatial)


def test_dropout_mask_is_shared_by_a_spatial_group_and_differs_across_data_groups(pools):
    masks = pools.run(4, cases.dropout_masks, spatial=(2, 1, 1))
    assert masks[0] == masks[1] and masks[2] == masks[3]
    assert masks[0] != masks[2]


def test_unused_parameters_are_named(pools):
    (message, _) = pools.run(2, cases.unused_parameter_is_reported, spatial=(2, 1, 1))
    assert "unused.weight" in message and "no gradient" in message


def _two_pools():
    return nn.Sequential(nn.Conv3d(1, 1, 3, padding=1), nn.MaxPool3d(2), nn.MaxPool3d(2))


def _conv2d():
    return nn.Sequential(nn.Conv2d(1, 1, 3))


def _reflect():
    return nn.Sequential(nn.Conv3d(1, 1, 3, padding=1, padding_mode="reflect"))


def _flatten_relu():
    return nn.Sequential(nn.Flatten(), nn.ReLU())


ERRORS = [
    ("stride-leaves-fewer-outputs-than-blocks", partial(nn.Conv3d, 1, 1, 3, stride=2, padding=1), (1, 1, 4, 4, 4),
     (4, 1, 1), r"layer 'Conv3d' \(Conv3d\): output size 2 along dim D \(input 4\) cannot be split 4 ways"),
    ("pooling-below-the-split", _two_pools, (1, 1, 4, 8, 4), (1, 4, 1),
     r"layer '2' \(MaxPool3d\): output size 2 along dim H \(input 4\) cannot be split 4 ways"),
    ("input-smaller-than-grid", partial(nn.Conv3d, 1, 1, 3), (1, 1, 4, 4, 3), (1, 1, 4),
     r"volume \(4, 4, 3\) cannot be split by spatial \(1, 1, 4\): dim W has 3 voxels for 4 blocks"),
    ("conv2d-refused", _conv2d, (1, 1, 4, 4, 4), (2, 1, 1),
     r"layer '0' \(Conv2d\) has no spatial-parallel form"),
    ("reflect-padding-refused", _reflect,
     (1, 1, 4, 4, 4), (2, 1, 1), r"layer '0' \(Conv3d\): padding_mode 'reflect'"),
    ("flatten-without-linear", _flatten_relu, (1, 1, 4, 4, 4), (2, 1, 1),
     r"layer '0' \(Flatten\)"),
]


@pytest.mark.parametrize("build,shape,spatial,expected", [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS])
def test_unsplittable_configurations_name_layer_dim_and_sizes(pools, build, shape, spatial, expected):
    world = spatial[0] * spatial[1] * spatial[2]
    messages = pools.run(world, cases.expect_error, build, shape, spatial=spatial, timeout=60)
    assert all(re.search(expected, m) for m in messages), messages
