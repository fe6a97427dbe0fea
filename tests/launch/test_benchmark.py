"""scripts/benchmark.py runs its subcommands and prints JSON lines ending with a summary
(tiny sizes: these check the plumbing, not the speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench_cli import benchmark as _benchmark

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> list[dict]:
    proc = _benchmark(*args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows and rows[-1]["kind"] == "summary"
    return rows


def test_step_measures_and_predicts_every_grid(tmp_path: Path):
    """The step benchmark times serial, spatial 2, data 2 and weak spatial 2, and predicts
    each from a calibration it measures (with each layer's local time) when none exists."""
    cal = tmp_path / "cal.json"
    rows = _run("step", "--models", "cosmoflow", "--size", "8", "--trials", "1", "--calibration", str(cal),
                "--cosmoflow-set", "model.n_conv_blocks=2", "model.conv_filters=4", "--plot", str(tmp_path),
                "--sync-world", "0")  # the 4-rank sync comparison: tests/ranks/test_noise_scale.py
    assert rows[-1]["plot"] == str(tmp_path / "step.png") and _is_png(tmp_path / "step.png")
    step = rows[0]
    grids = {"serial", "spatial2", "data2", "spatial2_weak"}
    # Every grid is measured and predicted; the floor (no communication) is measured only.
    assert set(step["measured_best_s"]) == set(step["measured_median_s"]) == grids | {"floor2", "data2_noise"}
    assert rows[-1]["cosmoflow_noise_over_flat_data2"] == step["noise_over_flat_data2"] > 0  # the noise scale's step
    assert set(step["predicted_s"]) == set(step["prediction_error"]) == grids
    assert all(v > 0 for v in step["predicted_s"].values())
    assert all(v > 0 for v in step["measured_best_s"].values())
    assert rows[-1]["cosmoflow_floor2_over_serial"] == step["floor_ratio_spatial2"] > 0
    saved = json.loads(cal.read_text())
    # Both blocks (serial and split along D) and both local batches (2, and 1 for data 2) were timed.
    keys = saved["layer_seconds"]
    assert any("in 2x4x8x8x8 | split 000" in k for k in keys) and any("in 1x4x8x8x8 | split 000" in k for k in keys)
    assert any("in 2x4x4x8x8 | split 100" in k for k in keys)
    # Errors against the median step (the calibration's times are medians), and the best's beside them.
    errors = {k: step["predicted_s"][k] / step["measured_median_s"][k] - 1 for k in grids}
    assert step["prediction_error"] == pytest.approx(errors)
    assert rows[-1]["cosmoflow_worst_prediction_error"] == max(abs(e) for e in step["prediction_error"].values())
    assert rows[-1]["cosmoflow_worst_prediction_error_vs_best"] == \
        max(abs(e) for e in step["prediction_error_vs_best"].values())


def test_layer_prints_the_halo_overhead_and_records_it(tmp_path: Path):
    """Both ratios (over the best plain conv on the block, over a pre-cut window), forward
    and backward apart, for the blocking, overlapped and whole-window paths; and
    ``--record FILE``: one record per summary, its figures the summary's, with the command
    (less where output went), the case (the arguments off their defaults) and the load,
    appended by the next run."""
    path = tmp_path / "results" / "layer.jsonl"
    rows = _run("layer", "--size", "12", "--channels", "2", "--trials", "2", "--record", str(path))
    assert rows[0]["kind"] == "layer" and rows[0]["local_block"] == [6, 12, 12]
    assert set(rows[0]["fair"]) == set(rows[0]["vs_window"]) == {"overlap", "blocking", "window_exchange"}
    assert set(rows[0]["fair"]["blocking"]) == {"total", "forward", "backward", "cpu"}
    seconds = rows[0]["seconds"]
    assert seconds["best_plain"] <= min(seconds["plain"], seconds["plain_torch"]) + 1e-9
    assert rows[-1]["halo_fair_2x1x1"] == rows[0]["fair"]["blocking"]["total"] > 0
    assert rows[-1]["halo_fair_overlap_forward_2x1x1"] > 0 and rows[-1]["halo_vs_window_2x1x1"] > 0

    _run("layer", "--size", "12", "--channels", "2", "--trials", "2", "--record", str(path))
    first, second = [json.loads(line) for line in path.read_text().splitlines()]
    summary = rows[-1]
    assert first["benchmark"] == "layer" and first["case"] == {"size": 12, "channels": 2, "trials": 2}
    assert first["figures"]["halo_fair_2x1x1"] == summary["halo_fair_2x1x1"]
    assert set(first["figures"]) == {k for k, v in summary.items() if isinstance(v, float) and "load" not in k}
    assert first["command"] == "python scripts/benchmark.py layer --size 12 --channels 2 --trials 2"
    assert first["load_before"] == summary["load_before"] and first["includes"] == summary["includes"]
    assert first["git"]["commit"] and first["machine"]["cores"] and first["torch"]
    assert second["figures"] != first["figures"] or second["date"] >= first["date"]  # appended, not replaced


def test_memory_from_outside_names_what_it_includes():
    """``memory --api --no-warmup``: no warm-up run before the baseline, and figures whose
    names say the one-time costs are in them; without ``--api`` it is refused."""
    rows = _run("memory", "--api", "--no-warmup", "--size", "8", "--splits", "1x1x1,2x1x1", "--set",
                "model.n_conv_blocks=2", "model.conv_filters=4", "model.dense_sizes=[4]")
    assert all(r["warmup_subtracted"] is False for r in rows)
    assert rows[-1]["spatial_2x1x1_peak_with_one_time_costs_over_serial"] == rows[1]["peak_ratio_to_serial"] > 0
    assert "one-time runtime costs of the first step included" in rows[-1]["includes"]
    refused = _benchmark("memory", "--no-warmup")
    assert refused.returncode != 0 and "--no-warmup: only with --api" in refused.stderr


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_reports_each_rank_above_its_own_baseline(tmp_path: Path):
    rows = _run("memory", "--size", "16", "--splits", "1x1x1,2x1x1", "--set", "model.n_conv_blocks=2",
                "model.conv_filters=8", "model.dense_sizes=[8]", "--plot", str(tmp_path))
    assert _is_png(tmp_path / "memory.png")
    serial, split = rows[0], rows[1]
    assert serial["spatial"] == [1, 1, 1] and split["spatial"] == [2, 1, 1]
    # The baseline is the rank's own resident memory after a warm-up step, not the peak a
    # spawned process inherits from its parent; the peak is above it.
    assert 0 < serial["baseline_bytes"] < serial["peak_bytes_per_rank"]
    assert serial["above_baseline_bytes"] > 0 and serial["ratio_to_serial"] == 1.0
    assert split["ratio_to_serial"] == rows[-1]["spatial2_over_serial"] > 0
    assert serial["predicted_above_baseline_bytes"] > split["predicted_above_baseline_bytes"] > 0


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _ranks_of(pid: int) -> list[int]:
    """The benchmark's rank processes: the children of its fork server (parallel.bench.ranks),
    or its own ``spawn_main`` children where it spawned them."""
    ranks = []
    for c in _children(pid):
        try:
            cmd = Path(f"/proc/{c}/cmdline").read_text(errors="replace")
        except OSError:
            continue
        if "forkserver" in cmd:
            ranks += _children(c)
        elif "spawn_main" in cmd:
            ranks.append(c)
    return ranks


def test_sigterm_stops_the_spawned_ranks_too():
    import os
    import signal
    import time

    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "benchmark.py"), "layer", "--size", "48",
                             "--channels", "16", "--trials", "50"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(ranks) < 2:
            ranks = _ranks_of(proc.pid)
            time.sleep(0.2)
        assert len(ranks) == 2, "the ranks did not start"
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        gone = time.monotonic() + 15
        while time.monotonic() < gone and any(Path(f"/proc/{r}").exists() for r in ranks):
            time.sleep(0.2)
        left = [r for r in ranks if Path(f"/proc/{r}").exists() and "Z" not in Path(f"/proc/{r}/stat").read_text()]
        assert not left, f"ranks {left} outlived the benchmark"
    finally:
        proc.kill()
        for r in set(ranks) | set(_children(proc.pid)):
            try:
                os.kill(r, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_io_reads_a_share_of_the_bytes_per_rank(tmp_path: Path):
    rows = _run("io", "--size", "16", "--samples", "2", "--codecs", "none,zstd", "--spatial", "2,2x2x1",
                "--repeat", "1", "--plot", str(tmp_path))
    by_codec = {r["codec"]: r for r in rows if r["kind"] == "io"}
    assert set(by_codec) == {"none", "zstd"}
    assert by_codec["none"]["blocks"]["2x1x1"]["share_of_whole_bytes"] == pytest.approx(0.5, abs=1e-3)
    assert by_codec["none"]["blocks"]["2x2x1"]["share_of_whole_bytes"] == pytest.approx(0.25, abs=1e-3)
    assert rows[-1]["plot"] == str(tmp_path / "io.png") and _is_png(tmp_path / "io.png")


def _uneven_layer(grid: Any, slowest: bool) -> float:
    import time

    import torch

    from parallel.bench.layer_times import _together

    return _together(lambda: time.sleep(0.05 if grid.rank == 1 else 0.0), 3, torch.device("cpu"), None,
                     slowest=slowest)


def test_busy_layer_times_take_the_slowest_rank_only_for_split_layers():
    """A split layer waits for its slowest rank (its exchanges); an unsplit one, as a
    data-parallel step runs it, does not: its busy time is the ranks' mean."""
    from parallel.bench.ranks import run_ranks

    slowest = run_ranks(2, _uneven_layer, True, timeout=120)
    mean = run_ranks(2, _uneven_layer, False, timeout=120)
    assert slowest[0] == slowest[1] and 0.05 <= slowest[0] < 0.09
    assert mean[0] == mean[1] and 0.025 <= mean[0] < 0.045


def test_peers_prints_the_project_and_block_rows_and_names_absent_peers():
    """One tiny case: the project's split conv (as parallelised, and on each forced path)
    against the block floor, ratios > 0; every peer this interpreter cannot import is
    reported absent (in the summary and the table) and skipped. And the whole CosmoFlow
    step case: the split step and the floor over the serial step, DistConv's beside them
    where it imports, in both layouts."""
    sys.path.insert(0, str(ROOT))
    from parallel.bench.peers import peer_status

    out = _benchmark("peers", "--cases", "conv-k3-s1-D-c2-n8,step-cosmoflow-D-n64", "--trials", "1",
                     "--channels-last")
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    row, step, summary = rows[0], rows[1], rows[-1]
    assert step["case"] == "step-cosmoflow-D-n64" and set(step["seconds"]) >= {"serial", "project", "floor"}
    assert 0 < step["over_serial"]["project"] and 0 < step["over_serial"]["floor"]
    # --channels-last: each contestant again with NDHWC activations, over the serial of its layout
    assert set(step["seconds"]) >= {"serial_cl", "project_cl", "floor_cl"} and step["over_serial"]["project_cl"] > 0
    assert ("distconv_cl" in step["seconds"]) == (peer_status()["distconv"] is None)
    assert step["best_serial"] in ("serial", "serial_cl") and step["over_best_serial"]["project_cl"] > 0
    assert summary["project_over_serial_step-cosmoflow-D-n64"] == step["over_serial"]["project"]
    assert ("distconv" in step["over_serial"]) == (peer_status()["distconv"] is None)
    assert row["kind"] == "peers" and row["case"] == "conv-k3-s1-D-c2-n8" and row["local_block"] == [4, 8, 8]
    assert set(row["over_block"]) >= {"project", "project_shell", "project_window"}
    assert all(v > 0 for v in row["over_block"].values())
    assert row["seconds"]["best_block"] <= min(row["seconds"]["block_torch"], row["seconds"]["block_reordered"])
    absent = {p for p, why in peer_status().items() if why is not None}
    assert set(summary["absent"]) == absent and summary["kind"] == "summary"
    for p in absent:
        assert f"{p}: absent (" in out.stderr
    assert summary["project_over_block_conv-k3-s1-D-c2-n8"] == row["over_block"]["project"]
    assert any(line.startswith("conv-k3-s1-D-c2-n8") for line in summary["table"])


def test_wall_draws_every_read_from_the_shared_bandwidth(tmp_path: Path):
    """2 ranks as 2 nodes, spatial 2: whole-sample reads draw twice the block reads' bytes;
    today's staging reads the data set once per node, read-once staging once per job."""
    rows = _run("wall", "--ranks", "2", "--size", "16", "--samples", "4", "--bandwidth", "2e7", "--compute", "0.01",
                "--epochs", "1", "--local-size", "1", "--measures", "whole,blocks,stage,once", "--plot", str(tmp_path))
    by = {r["measure"]: r for r in rows if r["kind"] == "wall"}
    assert by["whole"]["shared_bytes"] == pytest.approx(2 * by["blocks"]["shared_bytes"], rel=1e-3)  # + targets
    dataset = 4 * by["once"]["stored_bytes_per_sample"]
    assert by["once"]["shared_bytes"] == dataset and by["stage"]["shared_bytes"] == 2 * dataset
    assert all(r["nodes"] == 2 and r["predicted_epoch_s"] > 0 for r in by.values())
    assert rows[-1]["highest_ranks"] == 2 and _is_png(tmp_path / "wall.png")


def _who(grid: Any) -> tuple[int, int, bool]:
    import os

    return os.getpid(), grid.rank, "torch._dynamo" in sys.modules


def test_run_ranks_forks_new_ranks_with_torch_loaded_and_spawns_where_asked():
    # each call's ranks are new processes, forked from a server that imported torch once;
    # start="spawn" (the memory measurements) gives fresh interpreters, torch not yet loaded
    from parallel.bench.ranks import run_ranks

    first, second = run_ranks(2, _who), run_ranks(2, _who)
    assert [r[1] for r in first] == [0, 1] and all(r[2] for r in first + second)
    assert len({r[0] for r in first + second}) == 4 and os.getpid() not in {r[0] for r in first}
    spawned = run_ranks(1, _who, start="spawn")
    assert not spawned[0][2]
