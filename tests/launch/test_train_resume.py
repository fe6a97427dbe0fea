"""The run outputs, a checkpoint from 2 ranks loading serially, the MLPerf log, accumulation
and bf16 (the exact resume after kill -9: ``tests/launch/test_fail_checkpoint.py``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from train_helpers import launch, prepare, weights

TINY = ["--config-name", "quickstart", "train.global_batch_size=4", "model.conv_filters=4",
        "model.n_conv_blocks=2", "model.dense_sizes=[16]", "model.input_shift=3.8", "model.input_scale=2.0",
        "optim.lr=0.02", "run.progress=false", "run.log_rank=-3"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare("cosmoflow", tmp_path_factory.mktemp("cosmo16"), 16, 16, 8)



def test_outputs_and_checkpoint_loads_serially(data, tmp_path):
    run = tmp_path / "run"
    launch("cosmoflow", 2, [*TINY, f"data.dir={data}", "parallel.spatial=[2,1,1]", "train.epochs=2",
                            "train.target=10.0", f"run.dir={run}", "run.log_every=1"])
    ckpt = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert {"model", "optimizer", "step", "epoch", "sampler", "rng"} <= ckpt.keys()
    from cosmoflow.model import CosmoFlow, CosmoFlowConfig

    serial = CosmoFlow(CosmoFlowConfig(conv_filters=4, n_conv_blocks=2, dense_sizes=[16]), 16)
    serial.load_state_dict(ckpt["model"])  # a checkpoint from 2 ranks loads serially
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert train_rows and {"loss", "lr", "samples_per_s", "peak_memory_bytes", "bytes_read"} <= train_rows[0].keys()
    assert len(train_rows[0]["bytes_read"]) == 2 and min(train_rows[0]["bytes_read"]) > 0
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals and "val_mae" in evals[0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "success" and summary["time_to_target_s"] > 0  # target 10: first eval
    assert len(summary["bytes_read_per_rank_per_sample"]) == 2
    # each rank reads half of each sample's 4 x 16^3 int16 voxels (plus the 4 labels)
    assert summary["bytes_read_per_rank_per_sample"][0] < 4 * 16**3 * 2 * 0.6
    assert list((run / "tb").glob("events.out.tfevents.*"))

    log = (run / "mlperf.log").read_text().splitlines()
    keys = [json.loads(l.split(":::MLLOG ", 1)[1])["key"] for l in log if ":::MLLOG" in l]
    order = [keys.index(k) for k in ("init_start", "staging_start", "staging_stop", "init_stop", "run_start")]
    assert order == sorted(order) and keys[-1] == "run_stop"
    checker = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "hpc",
                              "--ruleset", "3.0.0", "--log_output", str(tmp_path / "checker.log"),
                              str(run / "mlperf.log")], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    problems = [l for l in (checker.stdout + checker.stderr).splitlines() if "WARNING" in l or "ERROR" in l]
    # a 2-epoch run cannot reach MAE 0.124: that check alone may fail, every other rule passes
    assert all("eval_error" in p or p.endswith("FAILED") for p in problems), problems


def test_gradient_accumulation_matches_and_bf16_runs(data, tmp_path):
    args = [*TINY, f"data.dir={data}", "model.dropout=0.0", "train.max_steps=3", "train.eval_at_end=false",
            "train.eval_every=0", "run.tensorboard=false"]
    launch("cosmoflow", 1, [*args, f"run.dir={tmp_path / 'a1'}"])
    launch("cosmoflow", 1, [*args, f"run.dir={tmp_path / 'a2'}", "train.accum_steps=2"])
    a, b = weights(tmp_path / "a1"), weights(tmp_path / "a2")
    for k in a:  # two half-batches summed in another order: float32 rounding only
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)
    launch("cosmoflow", 1, [*args, f"run.dir={tmp_path / 'bf'}", "train.precision=bf16"])
    c = weights(tmp_path / "bf")
    assert all(torch.isfinite(v).all() for v in c.values())
    assert any(not torch.equal(a[k], c[k]) for k in a)  # bf16 really changed the arithmetic
