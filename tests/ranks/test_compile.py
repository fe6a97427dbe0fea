"""``train.compile``: the split model compiled equals eager, forward and gradients on 2
ranks, breaking its graph only at the exchanges; where it cannot run it is refused, by name.

The tests compile with ``aot_eager`` (Dynamo's capture and AOT autograd's forward and backward
graphs, without Inductor's C++ build, which takes minutes on a loaded 2-core machine);
Inductor (``train.compile=true``) was checked by hand and measured: docs/training.md ("Where a step's time goes").
(A compiled training run: tests/launch/test_compile_training.py.)"""

import pytest
import torch

import compile_cases
from cosmoflow.family import CosmoFlowJob
from parallel.train.checks import ConfigError
from parallel.train.checks.config import validate_config


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
