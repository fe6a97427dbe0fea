"""The planner knows upsampling, padding and adaptive pools: their halos and exchanges,
and that everything after a global pool is whole on every rank (so a classification
network's 1x1x1 tail does not forbid every split, and its head costs as serial)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parallel import plan
from parallel.plan import Machine, Options
from parallel.plan import cli as plan_cli

MACHINE = Machine(conv_flops={}, default_conv_flops=1e9, mem_bandwidth=1e9, p2p_alpha=1e-4, p2p_beta=1e9,
                  ar_alpha=1e-4, ar_beta=1e9, layer_overhead=0.0, spatial_layer_overhead=0.0,
                  io_bandwidth=1e8, baseline_memory=1e8)


class Gate(nn.Module):
    """Squeeze-and-excitation: a global pool, pointwise convs on the pooled tensor, a product."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.squeeze = nn.Conv3d(c, 2, 1)
        self.excite = nn.Conv3d(2, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.excite(torch.relu(self.squeeze(self.pool(x)))))


class Net(nn.Module):
    """Pads, upsamples, gates and ends in a classifier head after a global pool."""

    def __init__(self) -> None:
        super().__init__()
        self.pad = nn.ConstantPad3d((1, 1, 2, 2, 0, 3), 0.5)
        self.conv = nn.Conv3d(1, 4, 3, stride=2)
        self.up = nn.Upsample(scale_factor=2, mode="trilinear")
        self.near = nn.Upsample(scale_factor=2, mode="nearest")
        self.shrink = nn.AdaptiveMaxPool3d(8)
        self.gate = Gate(4)
        self.head = nn.Sequential(nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(self.shrink(self.near(self.up(self.conv(self.pad(x)))))))


def _by_name(layers):
    return {l.name: l for l in layers}


def test_trace_gives_halos_and_follows_replication_through_the_forward():
    layers = _by_name(plan.trace(Net(), (1, 16, 16, 16)))
    assert layers["pad"].kind == "pad" and layers["pad"].halo == (3, 2, 1)  # the wider side, per dim D, H, W
    assert layers["pad"].out_shape == (1, 19, 20, 18)
    assert layers["up"].kind == "upsample" and layers["up"].halo == (1, 1, 1)  # trilinear: one neighbour
    assert layers["up"].out_shape == (4, 18, 18, 16)
    assert layers["near"].halo == (0, 0, 0)
    assert layers["shrink"].kind == "pool" and layers["shrink"].halo == (5, 5, 4)  # 36 -> 8: windows of 5
    assert layers["gate.pool"].kind == "gpool" and layers["gate.pool"].out_replicated
    assert not layers["gate.pool"].replicated
    assert layers["gate.squeeze"].replicated and layers["gate.excite"].replicated
    assert layers["gate.excite"].kind == "conv"
    assert not layers["head.0"].replicated and layers["head.0"].kind == "gpool"  # x * gate is split again
    assert layers["head.1"].replicated and layers["head.2"].replicated and layers["head.2"].kind == "linear"


def test_global_pool_tails_do_not_forbid_splits_and_cost_as_serial():
    layers = plan.trace(Net(), (1, 16, 16, 16))
    assert plan.valid(layers, (2, 1, 1)) and plan.valid(layers, (2, 2, 2)) and plan.valid(layers, (8, 1, 1))
    assert not plan.valid(layers, (16, 1, 1))  # the strided conv leaves 9 voxels along D
    ops = dict(zip((l.name for l in layers), plan.local_ops(layers, (2, 2, 1))))
    assert ops["head.2"].in_local == (4,) and not ops["head.2"].flat_split  # a plain Linear, no partial products
    assert ops["gate.squeeze"].in_local == (4, 1, 1, 1) and not any(ops["gate.squeeze"].split)
    assert ops["up"].out_local == (4, 9, 9, 16)
    opts = Options(global_batch=1)
    serial = plan.predict(layers, MACHINE, 1, (1, 1, 1), opts)
    split = plan.predict(layers, MACHINE, 1, (2, 1, 1), opts)
    assert serial["halo_s"] == 0 and split["halo_s"] > 0


def _exchange(layer_net: nn.Module, shape: tuple[int, ...], spatial: tuple[int, int, int]) -> float:
    layers = plan.trace(layer_net, shape)
    return plan.predict(layers, MACHINE, 1, spatial, Options(global_batch=1))["halo_s"]


@pytest.mark.parametrize("layer,expected", [
    # two messages per face, forward and backward: 2 x (2 alpha + 2 face bytes / beta)
    (nn.Upsample(scale_factor=2, mode="trilinear"), 2 * (2e-4 + 2 * 2 * 16 * 16 * 4 / 1e9)),
    (nn.Upsample(scale_factor=2, mode="nearest"), 0.0),
    (nn.ConstantPad3d(3, 0.0), 2 * (2e-4 + 2 * 2 * 16 * 16 * 3 * 4 / 1e9)),
    # a global pool: one partial result per channel from the other rank, forward and backward
    (nn.AdaptiveAvgPool3d(1), 2 * (1e-4 + 2 * 4 / 1e9)),
], ids=["trilinear", "nearest", "pad3", "global-pool"])
def test_exchange_costs_follow_the_halo(layer, expected):
    assert _exchange(layer, (2, 16, 16, 16), (2, 1, 1)) == pytest.approx(expected)
    assert _exchange(layer, (2, 16, 16, 16), (1, 1, 1)) == 0.0


@pytest.mark.parametrize("name,kwargs,size", [
    ("DenseNet121", dict(spatial_dims=3, in_channels=1, out_channels=4), 64),
    ("resnet10", dict(spatial_dims=3, n_input_channels=1, num_classes=4), 64),
    ("EfficientNetBN", dict(model_name="efficientnet-b0", pretrained=False, spatial_dims=3, in_channels=1,
                            num_classes=4), 64),
    ("SegResNet", dict(out_channels=3), 32),
])
def test_monai_networks_plan_with_spatial_splits(name, kwargs, size):
    import monai.networks.nets as nets

    layers = plan.trace(getattr(nets, name)(**kwargs), (1, size, size, size))
    rows = plan.table(layers, MACHINE, 4, float("inf"), Options(global_batch=4))
    assert {tuple(r["spatial"]) for r in rows} >= {(1, 1, 1), (2, 1, 1), (2, 2, 1)}, rows
    assert all(r["step_s"] > 0 and r["memory_bytes"] > 0 for r in rows)
    if name != "SegResNet":  # classifiers: the tail after the global pool is whole on every rank
        assert any(l.kind == "gpool" for l in layers) and layers[-1].replicated


def test_plan_cli_takes_a_network_by_target(capsys):
    code = plan_cli.main(["--model", "cosmoflow", "--size", "32", "--devices", "2", "--batch", "2", "--set",
                      "model._target_=monai.networks.nets.DenseNet", "model.spatial_dims=3", "model.in_channels=4",
                      "model.out_channels=4", "model.init_features=8", "model.growth_rate=4",
                      "model.block_config=[2,2]"])
    out = capsys.readouterr().out
    assert code == 0 and " 2x1x1 " in out and " 1x1x1 " in out, out
    assert plan_cli.main(["--model", "cosmoflow", "--devices", "2", "--set", "model._target_=no.Such"]) == 2
    assert "model._target_=no.Such: cannot build the network" in capsys.readouterr().err
