"""The planner's I/O term against a shared file system, and the shared bandwidth itself."""

from __future__ import annotations

import math
import time

import pytest

from parallel.data.bandwidth import SharedBandwidth
from parallel.plan.io import Measure, advice, describe, epoch_time

# 8 samples of 1 MB on 2 data x 2 spatial ranks and 2 nodes, 1 MB/s shared, 1 s compute a step.
KW = dict(samples=8, sample_bytes=1e6, data=2, spatial=2, nodes=2, fs_bandwidth=1e6, compute_step_s=1.0, epochs=2)


def test_epoch_time_of_each_measure_by_hand():
    # block reads: 4 steps, 2 MB a step over 1 MB/s = 2 s > 1 s of compute; the last compute is not hidden
    blocks = epoch_time(Measure("blocks"), **KW)
    assert blocks["epoch_s"] == pytest.approx(4 * 2 + 1) and blocks["wait_step_s"] == pytest.approx(1.0)
    assert epoch_time(Measure("whole", whole=True), **KW)["epoch_s"] == pytest.approx(4 * 4 + 1)  # 2x the bytes
    assert epoch_time(Measure("zstd", ratio=4.0), **KW)["epoch_s"] == pytest.approx(4 * 1 + 0.5)
    # staging: the data set (8 MB) once per node (today) or once per job, spread over 2 epochs, then compute only
    assert epoch_time(Measure("stage", staging="each"), **KW)["epoch_s"] == pytest.approx(16 / 2 + 4)
    once = epoch_time(Measure("once", staging="once"), **KW)
    assert once["epoch_s"] == pytest.approx(8 / 2 + 4) and once["wait_step_s"] == 0 and once["staging_bytes"] == 8e6
    # a rank's own read speed caps it too; a global batch of 4 halves the steps
    assert epoch_time(Measure("b"), **{**KW, "rank_bandwidth": 2.5e5})["io_step_s"] == pytest.approx(2.0)
    assert epoch_time(Measure("b"), **{**KW, "batch": 4})["epoch_s"] == pytest.approx(2 * 4 + 1)


def test_advice_names_the_wait_and_what_removes_it():
    measures = [Measure("blocks"), Measure("zstd", ratio=4.0), Measure("stage", staging="each"),
                Measure("once", staging="once")]
    a = advice(measures, measures[0], **KW)
    assert a["best"]["measure"] == "zstd" and a["removes_wait"] == ["zstd", "stage", "once"]
    text = "\n".join(describe(a, 1e6))
    assert "waits 1.000 s for data" in text and "fastest: zstd" in text
    kept = advice(measures, measures[0], **{**KW, "fs_bandwidth": 1e9})
    assert "keeps up" in "\n".join(describe(kept, 1e9))


def test_the_planner_adds_the_wait_for_a_shared_file_system():
    from parallel.plan import Machine, Options, build_model, predict, trace

    model, shape, stored = build_model("cosmoflow", [16, 16, 16], ["model.conv_filters=2", "model.n_conv_blocks=2",
                                                                   "model.dense_sizes=[4]"])
    layers = trace(model, shape)
    free = predict(layers, Machine.generic_machine("cpu"), 2, (2, 1, 1), Options(global_batch=4))
    fs = stored * 16 ** 3 * 4 / (3 * free["step_s"])  # the step's 4 samples take 3 steps' time to read
    slow = predict(layers, Machine.generic_machine("cpu"), 2, (2, 1, 1), Options(global_batch=4, fs_bandwidth=fs))
    assert slow["fs_read_s"] == pytest.approx(3 * free["step_s"])
    assert slow["io_wait_s"] == pytest.approx(2 * free["step_s"]) and slow["step_s"] == pytest.approx(slow["fs_read_s"])
    assert free["io_wait_s"] == 0


def test_shared_bandwidth_serves_draws_in_turn_and_counts_them(tmp_path):
    storage = SharedBandwidth(tmp_path / "ledger", rate=1e6, piece=50_000, burst=0.05)
    other = SharedBandwidth(tmp_path / "ledger", rate=1e6, burst=0.05)  # another process would open the same file
    t0 = time.monotonic()
    storage.draw(100_000)
    other.draw(200_000)
    assert time.monotonic() - t0 >= 0.3 - 0.05 - 1e-3  # 300 kB at 1 MB/s: never sooner (less the burst)
    assert storage.total() == other.total() == 300_000
    storage.reset()
    assert other.total() == 0
    with pytest.raises(ValueError, match="rate must be > 0"):
        SharedBandwidth(tmp_path / "x", rate=0)
    assert math.isfinite(storage.rate)


def test_the_plan_command_says_when_the_step_waits_and_what_removes_it(capsys):
    from parallel.plan.cli import main

    args = ["--size", "16", "--devices", "4", "--batch", "4", "--generic", "cpu", "--set", "model.conv_filters=2",
            "model.n_conv_blocks=2", "model.dense_sizes=[4]", "--samples", "64", "--ranks-per-node", "2"]
    assert main([*args, "--fs-bandwidth", "1e4"]) == 0
    out = capsys.readouterr().out
    assert "wait s" in out and "the step waits" in out and "no wait with:" in out and "read-once staging" in out
    assert main([*args, "--fs-bandwidth", "1e12"]) == 0
    assert "keeps up" in capsys.readouterr().out
    assert main(args) == 0
    assert "wait s" not in capsys.readouterr().out  # without a stated bandwidth the table is as before
