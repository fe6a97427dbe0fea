"""The performance model's arithmetic, its table of splits and ``parallel.spatial=auto``."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from parallel import plan
from parallel.plan import Machine, Options
from parallel.plan import cli as plan_cli
from parallel.train.checks import autosplit


def _layers(size: int = 32, blocks: int = 3):
    model, in_shape, _ = plan.build_model("cosmoflow", (size,) * 3, [f"model.n_conv_blocks={blocks}",
                                                                      "model.conv_filters=8"])
    return plan.trace(model, in_shape)


def test_trace_counts_conv_flops_and_shapes():
    layers = _layers()
    conv = [l for l in layers if l.kind == "conv"]
    assert len(conv) == 3 and conv[0].in_shape == (4, 32, 32, 32) and conv[0].out_shape == (8, 32, 32, 32)
    assert conv[0].flops == 2 * 4 * 8 * 27 * 32**3
    assert conv[0].halo == (1, 1, 1)
    assert [l.kind for l in layers[:3]] == ["conv", "other", "pool"]
    assert plan.first_layer(layers, 0) and not plan.first_layer(layers, 3)


def test_predict_arithmetic():
    layers = _layers()
    m = Machine(conv_flops={}, default_conv_flops=1e9, mem_bandwidth=1e9, p2p_alpha=1e-4, p2p_beta=1e9,
                ar_alpha=1e-4, ar_beta=1e9, layer_overhead=0.0, spatial_layer_overhead=0.0,
                io_bandwidth=1e8, baseline_memory=1e8, device="cuda")  # no native CPU kernel buffers (below)
    opts = Options(global_batch=2, stored_bytes_per_voxel=8, overlap=False)
    serial = plan.predict(layers, m, 1, (1, 1, 1), opts)
    split = plan.predict(layers, m, 1, (2, 1, 1), opts)
    data = plan.predict(layers, m, 2, (1, 1, 1), opts)
    conv0 = layers[0]
    assert serial["halo_s"] == 0 and serial["allreduce_s"] == 0
    assert serial["compute_s"] >= 2 * 2 * conv0.flops / 1e9  # first conv: fwd + weight grad, batch 2
    assert split["compute_s"] == pytest.approx(serial["compute_s"] / 2, rel=0.05)
    assert data["compute_s"] == pytest.approx(serial["compute_s"] / 2, rel=0.05)
    assert split["halo_s"] > 0 and data["halo_s"] == 0
    params = sum(l.params for l in layers)
    assert data["allreduce_s"] == pytest.approx(2 * 1e-4 + params * 4 / 1e9)
    assert serial["read_bytes"] == 8 * 32**3 * 2 and split["read_bytes"] == serial["read_bytes"] / 2
    assert data["read_bytes"] == serial["read_bytes"] / 2
    assert split["activation_bytes"] < 0.6 * serial["activation_bytes"]
    assert serial["memory_bytes"] == pytest.approx(1e8 + params * 4 * 3 + serial["activation_bytes"])
    hidden = plan.predict(layers, m, 1, (2, 1, 1), Options(global_batch=2, overlap=True))
    assert hidden["exposed_comm_s"] < split["exposed_comm_s"]
    recompute = plan.predict(layers, m, 1, (1, 1, 1), Options(global_batch=2, recompute=True))
    assert recompute["compute_s"] == pytest.approx(serial["compute_s"] * 4 / 3)
    # CosmoFlow's peak is in the first block's backward, where recomputation holds the same
    # tensors: no saving (as measured). The U-Net's blocks are alike: recomputation saves.
    assert recompute["activation_bytes"] == serial["activation_bytes"]
    first = [l for l in layers if l.block == 0]
    x = math.prod(layers[0].in_shape) * 4 * 2
    peak = x + sum(math.prod(l.out_shape) * 4 * 2 * (1.125 if l.kind == "pool" else 1) for l in first[:-1]) \
        + 4 * 2 * (math.prod(first[-2].out_shape) + math.prod(first[-2].in_shape))
    assert serial["activation_bytes"] == pytest.approx(peak)  # input, conv and act outputs, pool indices, 2 grads
    # On a CPU, torch's native kernel takes the thin first conv (batch x C x D x H <= 20480) and
    # holds C_in x 27 x output voxels of columns in its backward; a split block is reordered to oneDNN.
    m.device = "cpu"
    columns = layers[0].in_shape[0] * 27 * math.prod(layers[0].out_shape[1:]) * 2 * 4
    cpu = plan.predict(layers, m, 1, (1, 1, 1), opts)["activation_bytes"]
    assert cpu == pytest.approx(max(peak, x + 4 * 2 * (math.prod(layers[0].out_shape) + math.prod(layers[0].in_shape))
                                    + columns + math.prod(layers[0].out_shape) * 4 * 2))
    assert plan.predict(layers, m, 1, (2, 1, 1), opts)["activation_bytes"] == split["activation_bytes"]
    m.device = "cuda"
    unet, shape, _ = plan.build_model("unet3d", (16, 16, 16), ["model.depth=2", "model.base_filters=4"])
    ul = plan.trace(unet, shape)
    assert {l.block for l in ul if l.kind == "conv"} >= {0, 1, 2}
    plain_u = plan.predict(ul, m, 1, (1, 1, 1), Options(global_batch=2))
    rc_u = plan.predict(ul, m, 1, (1, 1, 1), Options(global_batch=2, recompute=True))
    assert rc_u["activation_bytes"] < 0.8 * plain_u["activation_bytes"]


def test_splits_and_choice():
    layers = _layers()
    rows = plan.splits(8, layers)
    assert all(d * math.prod(sp) == 8 for d, sp in rows)
    assert (8, (1, 1, 1)) in rows and (1, (2, 2, 2)) in rows
    assert (1, (4, 2, 1)) in rows and (1, (8, 1, 1)) not in rows  # 4^3 after the last pool
    m = Machine(baseline_memory=0.0)  # activations dominate: a tight limit needs a spatial split
    opts = Options(global_batch=8)
    table = plan.table(layers, m, 8, math.inf, opts)
    assert sum(r["best"] for r in table) == 1 and table[0]["best"]
    # Under a memory limit the choice is the fastest row that fits.
    limit = sorted(r["memory_bytes"] for r in table)[len(table) // 2]
    chosen = plan.choose(layers, m, 8, limit, opts)
    fitting = [r for r in table if r["memory_bytes"] <= limit]
    assert list(chosen) == min(fitting, key=lambda r: r["step_s"])["spatial"]
    with pytest.raises(ValueError):
        plan.choose(layers, m, 7, math.inf, Options(global_batch=1))  # 7 ranks, 1 sample: only 7-way, too thin


def test_auto_spatial_reads_the_volume_and_picks_a_valid_split(tmp_path: Path):
    from omegaconf import OmegaConf

    from cosmoflow.family import FAMILY, CosmoFlowJob
    from cosmoflow.fields import SPEC
    from parallel.data import write_samples
    from parallel.train.checks import read_facts

    (tmp_path / "train").mkdir()
    vol = np.zeros((1, 4, 32, 32, 32), dtype=np.int16)
    write_samples(tmp_path / "train" / "s0.h5", SPEC, {"volume": vol, "target": np.zeros((1, 4), np.float32)})
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(CosmoFlowJob), OmegaConf.from_dotlist(
        [f"data.dir={tmp_path}", "parallel.spatial=auto", "train.global_batch_size=1",
         "model.n_conv_blocks=3", "model.conv_filters=8"])))
    assert cfg.parallel.spatial == "auto"
    facts = read_facts(cfg.data, FAMILY)
    assert facts.volume == (32, 32, 32) and facts.stored_bytes_per_voxel == 2 * 4
    spatial = autosplit.auto_spatial(cfg, FAMILY, facts, world_size=4)
    assert len(spatial) == 3 and math.prod(spatial) == 4  # batch 1: no data parallelism possible
    assert autosplit.world_size_from_env({"WORLD_SIZE": "6"}) == 6
    assert autosplit.world_size_from_env({}) == 1


def test_cli_prints_a_table(capsys):
    assert plan_cli.main(["--model", "cosmoflow", "--size", "32", "--devices", "4", "--batch", "2",
                      "--set", "model.n_conv_blocks=3", "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "fastest that fits" in out and "2x1x1" in out


def test_measured_layer_times_replace_the_estimates():
    """``layer_times.layer_seconds`` times what a rank computes for each layer (a split conv's
    window, a split norm's two-pass statistics, the Linear's slice) and ``predict`` uses it."""
    from parallel.bench.layer_times import _local_call, layer_seconds

    for name, over in (("cosmoflow", ["model.n_conv_blocks=2", "model.conv_filters=4"]),
                       ("unet3d", ["model.depth=2", "model.base_filters=4"])):
        model, in_shape, _ = plan.build_model(name, (8, 8, 8), over)
        layers = plan.trace(model, in_shape)
        for spatial in ((1, 1, 1), (2, 1, 1), (1, 2, 2)):
            ops = plan.local_ops(layers, spatial)
            for layer, op in zip(layers, ops):
                fn, x = _local_call(layer, op, 2)
                if layer.kind in ("conv", "norm", "other", "pool") and len(op.out_local) == 4:
                    assert tuple(fn(x).shape) == (2, *op.out_local), (name, spatial, layer.name)
            times = layer_seconds(layers, [(spatial, 2)], trials=1)
            keys = {plan.op_key(l, op, 2) for l, op in zip(layers, ops)}
            assert keys == set(times) and all(t > 0 for t in times.values())
            m = Machine(layer_seconds={k: 1.0 for k in keys}, layer_overhead=0.0, spatial_layer_overhead=0.0)
            p = plan.predict(layers, m, 1, spatial, Options(global_batch=2))
            assert p["measured_layers"] == 1.0 and p["compute_s"] == pytest.approx(len(layers))
            if spatial == (2, 1, 1) and name == "cosmoflow":  # the Flatten+Linear all-reduce, fwd + bwd
                assert sum(op.flat_split for op in ops) == 1
                m.p2p_alpha, m.p2p_beta, m.ar_alpha, m.ar_beta = 0.0, math.inf, 1.0, math.inf
                assert plan.predict(layers, m, 1, spatial, Options(global_batch=2))["halo_s"] == pytest.approx(4.0)
    # Keys not measured fall back to the throughput estimate.
    m = Machine(layer_seconds={}, layer_overhead=0.0)
    assert plan.predict(layers, m, 1, (1, 1, 1), Options(global_batch=2))["measured_layers"] == 0.0


def test_calibration_files_named_but_missing_or_broken_are_errors(tmp_path: Path, capsys):
    assert plan_cli.main(["--model", "cosmoflow", "--size", "32", "--devices", "2", "--set", "model.n_conv_blocks=3",
                      "--calibration", str(tmp_path / "nope.json")]) == 2
    assert "nope.json not found" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json is unreadable"):
        Machine.load(broken)
    good = tmp_path / "good.json"
    good.write_text('{"p2p_alpha": 0.5, "unknown_field": 1}')
    assert Machine.load(good).p2p_alpha == 0.5
