"""``train.compile`` (issue 24, Deliver 4): the split model compiled equals eager, forward and
gradients on 2 ranks and over a short training run; where it cannot run it is refused, by name.

The tests compile with ``aot_eager`` (Dynamo's capture and AOT autograd's forward and backward
graphs, without Inductor's C++ build, which takes minutes on a loaded 2-core machine);
Inductor (``train.compile=true``) was checked by hand and measured: docs/performance.md."""

from __future__ import annotations

import json

import pytest
import torch

import compile_cases
from cosmoflow.family import CosmoFlowJob
from parallel.train.checks import ConfigError
from parallel.train.checks.config import validate_config
from train_helpers import launch, prepare, weights


def test_split_model_compiled_equals_eager_and_breaks_only_at_the_exchanges(pools):
    results = pools.run(2, compile_cases.compiled_equals_eager, "aot_eager", spatial=(2, 1, 1), timeout=300)
    for r in results:
        assert r["graphs"] >= 2 and r["convolutions"] >= 2, r  # the computation is compiled ...
        assert r["messages"] == [], r  # ... the halo exchange's messages are not: the graph breaks there
        # (Dynamo traces a plain all-reduce or all-gather into the graph as a functional collective,
        # which it proves correct itself; the equality above holds with them)
        assert all(c.startswith("_c10d_functional.") for c in r["collectives"]), r


def _job(**train) -> CosmoFlowJob:
    job = CosmoFlowJob()
    for key, value in train.items():
        setattr(job.train, key, value)
    return job


def test_compile_refusals_name_the_reason(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match=r"train.compile=nope: torch .* has no compile backend 'nope'.*aot_eager"):
        validate_config(_job(compile="nope"))
    with pytest.raises(ConfigError, match="train.compile=true with optim.name=kfac: K-FAC"):
        job = _job(compile=True)
        job.optim.name = "kfac"
        validate_config(job)
    validate_config(_job(compile="aot_eager", activation_checkpointing=True))  # allowed: proven in the ranks' test
    if not torch.cuda.is_available():  # Inductor's CPU kernels need a C++ compiler: a PATH without one
        monkeypatch.delenv("CXX", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path))
        with pytest.raises(ConfigError, match=r"train.compile=true: Inductor builds its CPU kernels with a C\+\+ "
                                              r"compiler and none of c\+\+, g\+\+, clang\+\+ is on PATH"):
            validate_config(_job(compile=True))
        validate_config(_job(compile="aot_eager"))  # no compiler needed there
    with pytest.raises(ConfigError, match="train.profile=-1: want >= 0"):
        validate_config(_job(profile=-1))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare("cosmoflow", tmp_path_factory.mktemp("cosmo16"), 16, 8, 4)


@pytest.mark.launch
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
