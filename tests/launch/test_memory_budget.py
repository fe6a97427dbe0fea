"""``parallel.memory_limit``: a grid whose predicted peak does not fit is refused before the
first step (exit 2, with the numbers and the smallest split that fits), ``auto`` plans
for the budget, and on CPUs a rank that goes over it while running stops the job with a
message naming the budget and what it held."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from cosmoflow.family import FAMILY, CosmoFlowJob
from parallel import plan
from parallel.job.config import to_dataclass
from parallel.train.checks import autosplit, read_facts
from parallel.train.cli import CONFIG_ROOT, register
from train_helpers import REPO, launch, prepare

TESTS = Path(__file__).resolve().parents[1] / "support"
SIZE = 128  # CosmoFlow's 4-filter first block at 128^3: ~260 MB of activations serially, ~95 MB split 2 ways
COMMON = ["--config-name", "smoke", "train.global_batch_size=1", "train.max_steps=2", "train.eval_every=0",
          "train.eval_at_end=false", "data.workers=0", "model.conv_filters=4"]
MIB = 2**20
SIZE_RE = r"([0-9.]+) (MiB|GiB)"


def _bytes(number: str, unit: str) -> float:
    return float(number) * (MIB if unit == "MiB" else 2**30)


def _refusal(text: str) -> dict[str, float]:
    """The numbers of a refusal: predicted peak, runtime, activations, budget."""
    m = re.search(rf"is {SIZE_RE} \(runtime {SIZE_RE} \+ weights, gradients and optimiser {SIZE_RE} \+ "
                  rf"activations {SIZE_RE}\), over the budget of {SIZE_RE}", text)
    assert m, text[-3000:]
    vals = [_bytes(m.group(i), m.group(i + 1)) for i in range(1, 11, 2)]
    return dict(zip(("peak", "runtime", "states", "activations", "budget"), vals))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare("cosmoflow", tmp_path_factory.mktemp("cf128"), SIZE, 2, 1)


def _cfg(data: Path, *overrides: str) -> CosmoFlowJob:
    register(FAMILY)
    with initialize_config_dir(config_dir=str(CONFIG_ROOT / "cosmoflow"), version_base=None):
        return to_dataclass(compose(config_name="smoke", overrides=[f"data.dir={data}", *COMMON[2:], *overrides]),
                            CosmoFlowJob)


def test_memory_limit_values(data: Path):
    """Bytes or sizes; anything else names the key."""
    for text, want in (("3GiB", 3 * 2**30), ("500MB", 5e8), ("1048576", 2**20), ("null", None)):
        assert autosplit.memory_limit_bytes(_cfg(data, f"parallel.memory_limit={text}").parallel.memory_limit) == want
    for bad in ("lots", "-1GB"):
        with pytest.raises(ValueError, match="parallel.memory_limit"):
            autosplit.memory_limit_bytes(_cfg(data, f"parallel.memory_limit={bad}").parallel.memory_limit)


def test_auto_plans_for_the_budget(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Two ranks, global batch 2, on a machine where a split layer costs a second: with room,
    data parallelism (each rank a whole sample) is fastest; with a budget only a split
    sample fits, ``auto`` takes it; with a budget nothing fits, it refuses with the numbers."""
    slow_split = tmp_path / "calibration.json"
    slow_split.write_text(json.dumps({"spatial_layer_overhead": 1.0}))
    monkeypatch.setenv("SPATIALCNN_CALIBRATION", str(slow_split))
    cfg = _cfg(data, "train.global_batch_size=2")
    facts = read_facts(cfg.data, FAMILY)
    layers, machine, opts = autosplit.job_plan(cfg, FAMILY, facts)
    whole = plan.predict(layers, machine, 2, (1, 1, 1), opts)["memory_bytes"]
    split = plan.predict(layers, machine, 1, (2, 1, 1), opts)["memory_bytes"]
    assert split < whole - 40 * MIB, (split, whole)
    roomy = autosplit.auto_spatial(_cfg(data, "train.global_batch_size=2", "parallel.memory_limit=100GiB"), FAMILY,
                                   facts, world_size=2)
    budget = int((split + whole) / 2)
    tight = autosplit.auto_spatial(_cfg(data, "train.global_batch_size=2", f"parallel.memory_limit={budget}"),
                                   FAMILY, facts, world_size=2)
    assert tight == [2, 1, 1]
    assert roomy == [1, 1, 1]
    with pytest.raises(ValueError, match=r"no split of 2 ranks fits parallel.memory_limit=.*smallest split that fits "
                                         r"is parallel.spatial=\[\d,\d,\d\]"):
        autosplit.auto_spatial(_cfg(data, "train.global_batch_size=2", f"parallel.memory_limit={int(split * 0.9)}"),
                               FAMILY, facts, world_size=2)


def test_refused_before_the_first_step_then_auto_trains_within_it(data: Path, tmp_path: Path):
    """Serial refused with exit 2 and the numbers (predicted peak, budget, the smallest split
    that fits); ``auto`` on two ranks trains under the same budget, every rank's peak in it."""
    base = ["cosmoflow", 1, [*COMMON, f"data.dir={data}", "data.val_subdir=val", "parallel.spatial=[1,1,1]"]]
    # The runtime part of a prediction is this worker's own resident memory: a first refusal
    # (a budget nothing meets) says how much, so the budget below sits between the two grids.
    probe = launch(*base[:2], [*base[2], "parallel.memory_limit=1MB", f"run.dir={tmp_path / 'probe'}"],
                   check=False)
    assert probe.returncode == 2, probe.stderr[-3000:]
    first = _refusal(probe.stderr)
    budget = int(first["runtime"] + first["states"] + 0.6 * first["activations"])
    serial = launch(*base[:2], [*base[2], f"parallel.memory_limit={budget}", f"run.dir={tmp_path / 'serial'}"],
                    check=False)
    assert serial.returncode == 2, serial.stderr[-3000:]
    got = _refusal(serial.stderr)
    assert got["peak"] > got["budget"] and abs(got["budget"] - budget) < MIB, got
    hint = re.search(r"the smallest split that fits is parallel.spatial=\[(\d),(\d),(\d)\] \(\d+ ranks per sample, "
                     r"x 1 data groups\): predicted (\d+) MiB per rank", serial.stderr)
    assert hint, serial.stderr[-3000:]
    assert int(hint.group(1)) * int(hint.group(2)) * int(hint.group(3)) >= 2 and int(hint.group(4)) * MIB <= budget
    assert not (tmp_path / "serial" / "summary.json").exists()

    run = tmp_path / "auto"
    proc = launch("cosmoflow", 2, [*COMMON, f"data.dir={data}", "data.val_subdir=val", "parallel.spatial=auto",
                                   f"parallel.memory_limit={budget}", f"run.dir={run}"], check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["grid"]["spatial"] == [2, 1, 1] and summary["steps"] == 2
    assert summary["memory_limit_bytes"] == budget
    assert summary["predicted_peak_memory_bytes"] <= budget
    assert max(summary["peak_memory_bytes_per_rank"]) <= budget, summary["peak_memory_bytes_per_rank"]
    assert len(summary["peak_memory_over_predicted_per_rank"]) == 2


def test_a_rank_over_its_budget_stops_the_job(data: Path, tmp_path: Path):
    """A model that keeps 96 MiB per step (a leak the planner cannot see) passes the check and
    then goes over a 700 MB budget within a few steps: the rank stops with the message naming
    the budget and what it held, its peer stops naming it, instead of the kernel's OOM killer."""
    small = prepare("cosmoflow", tmp_path / "cf16", 16, 4, 1)
    extra = {"PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = launch("cosmoflow", 2, ["--config-name", "smoke", f"data.dir={small}", "data.val_subdir=val",
                                   "train.global_batch_size=2", "train.max_steps=12", "train.eval_every=0",
                                   "train.eval_at_end=false", "data.workers=0", "parallel.spatial=[2,1,1]",
                                   "model._target_=budget_models.LeakyRegressor", "model.leak_mb=96", "model.delay_s=0.3",
                                   "parallel.memory_limit=700MB", "parallel.heartbeat_s=0.5",
                                   f"run.dir={tmp_path / 'run'}"],
                  launcher="torchrun", check=False, extra_env=extra, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    m = re.search(r"rank (\d) went over its memory budget: resident ([0-9.]+) MiB > 667.6 MiB "
                  r"\(parallel.memory_limit=700MB; predicted peak ([0-9.]+) MiB\)", out)
    assert m, out[-4000:]
    assert float(m.group(2)) > 667.5 > float(m.group(3))
    assert re.search(rf"rank {1 - int(m.group(1))}: stopping: rank {m.group(1)} failed: MemoryBudgetExceeded", out) \
        or "exitcode  : 2" in out, out[-4000:]
    assert not (tmp_path / "run" / "summary.json").exists()


def test_node_descriptions_route_halos_by_group_size():
    """A spatial group inside a node exchanges over NVLink, a larger one over its GPUs' share of
    InfiniBand; the gradient all-reduce crosses nodes once the job does; a V100's 16 GB is
    the memory a row must fit."""
    from parallel.plan.machines import NODES, machine_for, predict_on

    lassen = NODES["lassen"]
    inside, across = machine_for(lassen, 1, (4, 1, 1)), machine_for(lassen, 1, (8, 1, 1))
    assert inside.p2p_beta == lassen.intra_beta and across.p2p_beta == lassen.inter_beta
    assert inside.ar_beta == lassen.intra_beta and machine_for(lassen, 2, (4, 1, 1)).ar_beta == lassen.inter_beta
    model, shape, stored = plan.build_model("cosmoflow", (64, 64, 64), ["model.conv_filters=4"])
    layers = plan.trace(model, shape)
    opts = plan.Options(global_batch=8, stored_bytes_per_voxel=stored)
    near, far = (predict_on(lassen, layers, 1, sp, opts) for sp in ((4, 1, 1), (4, 2, 1)))
    assert near["gpus"] == 4 and near["nodes"] == 1 and far["nodes"] == 2 and near["fits"]
    assert near["node_read_bandwidth"] == pytest.approx(near["read_bytes"] * 4 / near["step_s"])
