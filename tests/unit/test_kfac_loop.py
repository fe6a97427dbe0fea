"""K-FAC as ``optim.name=kfac`` of the shared loop, in one process: its config and
validation, ``build_optimizer`` (with chosen weight decay), the MLPerf log's division and
keys, and its costs in ``parallel.plan``."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from mlperf_logging.mllog import constants as C

import kfac_cases
from cosmoflow.family import FAMILY as COSMO
from parallel.grid import Grid
from parallel.job.config import OptimConfig, to_dataclass
from parallel.kfac import KFAC, KFACConfig, kfac_costs
from parallel.plan import Machine, Options, predict, trace
from parallel.plan.cli import main as plan_main
from parallel.plan.kfac import KFACPlan, kfac_config
from parallel.train.checks import ConfigError, validate_config
from parallel.train.cli import CONFIG_ROOT, register
from parallel.train.observe.mlperf import MLPerfLog, log_submission
from parallel.train.optim import build_optimizer


def _job(overrides: list[str]):
    register(COSMO)
    with initialize_config_dir(config_dir=str(CONFIG_ROOT / "cosmoflow"), version_base=None):
        return to_dataclass(compose(config_name="quickstart", overrides=overrides), COSMO.config_class)


def test_kfac_settings_compose_from_the_command_line():
    job = _job(["optim.name=kfac", "optim.kfac.damping=0.01", "optim.kfac.factor_interval=5",
                "optim.kfac.inverse_interval=20", "optim.kfac.exclude=[head.*]", "optim.kfac.factor_dtype=float64"])
    k = job.optim.kfac
    assert str(job.optim.name) == "kfac" and isinstance(k, KFACConfig)
    assert (k.damping, k.factor_interval, k.inverse_interval, k.exclude) == (0.01, 5, 20, ["head.*"])
    assert k.factor_dtype.torch == torch.float64
    validate_config(job)


@pytest.mark.parametrize("overrides,match", [
    (["optim.kfac.damping=0"], r"optim\.kfac\.damping must be > 0, got 0"),
    (["optim.kfac.inverse_interval=15"], r"optim\.kfac\.inverse_interval \(15\) must be a multiple of "
                                         r"kfac\.factor_interval \(10\)"),
    (["optim.kfac.inverse_dtype=bfloat16"], r"optim\.kfac\.inverse_dtype must be float32, float64 or auto"),
    (["optim.momentum_form=keras"], r"optim\.momentum_form=keras: optim\.name=kfac takes torch's SGD step"),
], ids=["damping", "intervals", "inverse-dtype", "keras-momentum"])
def test_bad_kfac_settings_are_config_errors_naming_the_key(overrides, match):
    job = _job(["optim.name=kfac", *overrides])
    with pytest.raises(ConfigError, match=match):
        validate_config(job)
    validate_config(_job(overrides))  # SGD does not read optim.kfac (keras momentum is its own)


def test_build_optimizer_makes_kfac_and_decays_only_the_named_weights():
    torch.manual_seed(0)
    base = kfac_cases.build().double()
    x, y = torch.randn(4, *kfac_cases.SHAPE[1:], dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    cfg = OptimConfig(name="kfac", lr=0.05, momentum=0.9, weight_decay=0.1,
                      kfac=KFACConfig(factor_interval=1, inverse_interval=1))
    runs = {}
    for label, decayed, wd in [("named", ["2.weight"], 0.1), ("none", None, 0.0)]:
        model = copy.deepcopy(base)
        opt = build_optimizer(model.named_parameters(), OptimConfig(**{**cfg.__dict__, "weight_decay": wd}),
                              decayed=decayed, model=model)
        assert isinstance(opt, KFAC) and len(opt.layers) == 7
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        runs[label] = dict(model.named_parameters())
    # K-FAC preconditions, then SGD adds the decay of the named weight alone
    for name, p in runs["named"].items():
        same = torch.equal(p, runs["none"][name])
        assert same == (name != "2.weight"), name
    with pytest.raises(ValueError, match="optim.name=kfac needs the model"):
        build_optimizer(base.parameters(), cfg)
    with pytest.raises(ValueError, match="do not include them"):
        KFAC(base, None, KFACConfig(), lr=0.1, params=[next(base.parameters())])


def _hpc_log(path: Path, job) -> None:
    """What the loop writes around log_submission, for a run that reaches the target."""
    ml = MLPerfLog(path)
    log_submission(ml, job, Grid((1, 1, 1), 1, 0), "cosmoflow", n_nodes=1)
    ml.start(C.STAGING_START)
    ml.end(C.STAGING_STOP, staging_duration=0.0)
    ml.event(C.TRAIN_SAMPLES, 2048)
    ml.event(C.EVAL_SAMPLES, 128)
    ml.end(C.INIT_STOP)
    ml.start(C.RUN_START)
    ml.start(C.EPOCH_START, epoch_num=1)
    ml.end(C.EPOCH_STOP, epoch_num=1)
    ml.start(C.EVAL_START, epoch_num=1)
    ml.event("eval_error", 0.1, epoch_num=1)
    ml.end(C.EVAL_STOP, epoch_num=1)
    ml.end(C.RUN_STOP, status="success")
    ml.close()


def test_a_kfac_run_never_claims_the_closed_division(tmp_path):
    job = _job(["optim.name=kfac"])
    assert str(job.mlperf.division) == "closed"  # the quickstart's setting
    _hpc_log(tmp_path / "kfac.log", job)
    text = (tmp_path / "kfac.log").read_text()
    assert '"key": "submission_division", "value": "open"' in text
    assert '"key": "opt_name", "value": "kfac"' in text and '"key": "opt_kfac_damping", "value": 0.001' in text
    proc = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "hpc", "--ruleset",
                           "3.0.0", str(tmp_path / "kfac.log")], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the open division's rules pass
    _hpc_log(tmp_path / "sgd.log", _job([]))
    assert '"key": "submission_division", "value": "closed"' in (tmp_path / "sgd.log").read_text()


def test_plan_adds_kfac_work_and_memory_to_the_step():
    from cosmoflow.model import CosmoFlow, CosmoFlowConfig

    with torch.device("meta"):
        model = CosmoFlow(CosmoFlowConfig(), 64)
    layers = trace(model, (4, 64, 64, 64))
    m = Machine()
    cfg = KFACConfig(factor_interval=5, inverse_interval=20)
    plain = predict(layers, m, 2, (2, 1, 1), Options(global_batch=8))
    with_kfac = predict(layers, m, 2, (2, 1, 1), Options(global_batch=8, kfac=KFACPlan(model, (4, 64, 64, 64), cfg)))
    costs = kfac_costs(model, (8, 4, 64, 64, 64), cfg, spatial=(2, 1, 1), world_size=4)
    assert with_kfac["step_s"] == pytest.approx(plain["step_s"] + with_kfac["kfac_s"])
    assert with_kfac["memory_bytes"] == pytest.approx(plain["memory_bytes"] + costs.memory_bytes)
    assert with_kfac["kfac_factor_s"] == pytest.approx(costs.factor_flops / 5 / m.default_conv_flops
                                                       + 2 * costs.patch_bytes / 5 / m.mem_bandwidth)
    # the first conv's patches: 4 samples a data group, half of 64^3 positions, 4 x 27 + 1 wide
    assert costs.patch_bytes > 4 * 4 * 64**3 // 2 * 109
    assert with_kfac["kfac_inverse_s"] == pytest.approx(costs.inverse_flops / 20 / m.default_conv_flops)
    assert with_kfac["kfac_allreduce_s"] > 0 and with_kfac["kfac_broadcast_s"] > 0
    assert with_kfac["kfac_plain_layers"] == []  # A 6913 and 4097 wide > 4096: held low rank
    assert with_kfac["kfac_low_rank_layers"] == ["features.12 (A 6913 wide, rank 128)", "head.1 (A 4097 wide, rank 128)"]
    plain = predict(layers, m, 2, (2, 1, 1), Options(global_batch=8, kfac=KFACPlan(
        model, (4, 64, 64, 64), KFACConfig(factor_interval=5, inverse_interval=20, wide_factors="plain"))))
    assert plain["kfac_plain_layers"] == ["features.12", "head.1"]


def test_plan_command_prints_kfac_share_and_refuses_bad_settings(capsys):
    assert plan_main(["--model", "cosmoflow", "--size", "32", "--devices", "2", "--optim", "kfac",
                      "--kfac", "factor_interval=5", "inverse_interval=50"]) == 0
    out = capsys.readouterr().out
    assert "K-FAC on" in out and "factor update every 5 steps" in out and "inverse update every 50 steps" in out
    assert plan_main(["--model", "cosmoflow", "--size", "32", "--devices", "2", "--kfac", "damping=0"]) == 2
    assert "kfac.damping must be > 0" in capsys.readouterr().err
    assert kfac_config(["exclude=[head.*]"]).exclude == ["head.*"]
    with pytest.raises(ValueError, match="--kfac"):
        kfac_config(["no_such_setting=1"])
