"""Verification against the serial model: functional spatial operations in a model's own
forward are stopped, naming the module; correct models pass and are left as they were."""

import pytest
import torch
from torch import nn

import verify_cases as vc
from parallel.grid import Grid
from parallel.verify import custom_forwards, probe_shape


@pytest.mark.parametrize("world,spatial", [(2, (2, 1, 1)), (4, (1, 2, 1))], ids=["spatial2x1x1", "data2-x-1x2x1"])
def test_interpolate_in_forward_is_stopped_naming_the_module(pools, world, spatial):
    messages = pools.run(world, vc.stopped, "interpolate", spatial=spatial)
    assert len(set(messages)) == 1, messages  # every rank stops with the same verdict
    message = messages[0]
    assert "the output of module 'middle' (Up) differs" in message, message
    assert "F.interpolate on a split tensor" in message and "in the forward of 'middle' (Up)" in message, message


def test_cat_along_w_is_stopped_naming_the_module(pools):
    message = pools.run(2, vc.stopped, "cat-w", spatial=(1, 1, 2))[0]
    assert "the output of module 'middle' (Widen) differs" in message, message
    assert "torch.cat along dim 4 (W) of split tensors" in message and "'middle' (Widen)" in message, message


@pytest.mark.parametrize("world,spatial,probe", [(2, (2, 1, 1), None), (4, (1, 1, 2), (2, 1, 4, 6, 8)),
                                                 (4, (2, 2, 1), None)],
                         ids=["auto-probe-D2", "data2-x-W2-given-probe", "2x2x1-auto-probe"])
def test_correct_model_verifies_and_is_left_unchanged(pools, world, spatial, probe):
    reports = pools.run(world, vc.passes, "good", probe, spatial=spatial)
    assert all(r["outputs"] < 1e-4 and r["gradients"] < 1e-4 for r in reports), reports


def test_probe_is_sized_from_the_network_downsampling():
    from monai.networks.nets import UNet

    net = UNet(3, 2, 1, (4, 8, 16, 32), (2, 2, 2), num_res_units=1)  # total stride 8
    grid = Grid(spatial=(2, 1, 4), world_size=16, rank=0)
    assert probe_shape(net, grid) == (2, 2, 16, 16, 32)
    # a float64 network (train.precision=fp64) is sized alike: its dry run takes the weights' dtype
    assert probe_shape(net.double(), grid) == (2, 2, 16, 16, 32)


def test_custom_forwards_lists_code_parallelize_cannot_see():
    assert custom_forwards(nn.Sequential(nn.Conv3d(1, 1, 3), nn.ReLU())) == []
    assert custom_forwards(vc.Net(vc.Up())) == ["Net", "middle"]
    assert torch.is_tensor(torch.zeros(1))


@pytest.mark.parametrize("world,spatial", [(2, (2, 1, 1)), (4, (1, 2, 2))], ids=["D2", "H2W2"])
def test_flatten_linear_head_on_the_split_volume_verifies(pools, world, spatial):
    reports = pools.run(world, vc.cosmoflow_verifies, spatial=spatial)
    assert all(r["outputs"] < 1e-4 and r["gradients"] < 1e-4 for r in reports), reports
