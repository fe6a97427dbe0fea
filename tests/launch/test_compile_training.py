"""``train.compile`` over a short training run: a compiled run ends with the eager run's
weights. Compiled with ``aot_eager`` (Dynamo's capture and AOT autograd's graphs, without
Inductor's C++ build, which takes minutes on a loaded 2-core machine); Inductor
(``train.compile=true``) was checked by hand and measured: docs/training.md ("Where a step's time goes")."""

import json

import pytest
import torch

from train_helpers import launch, prepare, weights


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare("cosmoflow", tmp_path_factory.mktemp("cosmo16"), 16, 8, 4)



def test_a_compiled_training_run_equals_eager(data, tmp_path):
    common = ["--config-name", "smoke", f"data.dir={data}", "parallel.spatial=[2,1,1]", "train.max_steps=2",
              "train.eval_at_end=false", "run.log_every=1"]
    launch("cosmoflow", 2, [*common, f"run.dir={tmp_path / 'eager'}"])
    proc = launch("cosmoflow", 2, [*common, f"run.dir={tmp_path / 'compiled'}", "train.compile=aot_eager"],
                  timeout=400)
    assert "train.compile: the split model compiled with aot_eager" in proc.stderr, proc.stderr[-3000:]
    eager, compiled = weights(tmp_path / "eager"), weights(tmp_path / "compiled")
    assert list(compiled) == list(eager)  # the serial model's keys: checkpoints do not change
    for key in eager:  # float32 over 2 SGD steps; a compiler may reorder sums: relative 1e-5
        torch.testing.assert_close(compiled[key], eager[key], rtol=1e-5, atol=1e-6, msg=key)
    first = [_first_step_s(tmp_path / run) for run in ("eager", "compiled")]
    assert first[1] > 3 * first[0], first  # the compiled run's first step compiled (seconds, not a tenth)



def _first_step_s(run) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return next(row["time_step_s"] for row in rows if row["kind"] == "train")
