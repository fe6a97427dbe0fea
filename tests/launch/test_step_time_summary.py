"""Where a step's time goes, as a user sees it: a 2-rank run of a 16^3 CosmoFlow puts the
per-step breakdown into compute, halo exchange, gradient all-reduce and data waiting in
the summary, metrics.jsonl and TensorBoard, and ``train.profile=N`` writes per-rank traces
naming the exchange and the all-reduce."""

import json
from pathlib import Path

import pytest

from parallel.train.observe.steptime import PARTS
from train_helpers import launch, prepare


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare("cosmoflow", tmp_path_factory.mktemp("cosmo16"), 16, 8, 4)



def _events(trace: Path) -> list[dict]:
    raw = json.loads(trace.read_text())
    return raw["traceEvents"] if isinstance(raw, dict) else raw



def test_summary_breakdown_tensorboard_and_profile_traces(data, tmp_path):
    """2 ranks split along D: the summary's parts are plausible and add up, TensorBoard has
    them, and each rank's trace holds named exchange and all-reduce events inside a step."""
    run = tmp_path / "run"
    proc = launch("cosmoflow", 2, ["--config-name", "smoke", f"data.dir={data}", f"run.dir={run}",
                                   "parallel.spatial=[2,1,1]", "train.max_steps=3", "train.profile=1",
                                   "run.log_every=1", "run.tensorboard=true", "train.eval_at_end=false"],
                  timeout=240)
    st = json.loads((run / "summary.json").read_text())["step_time"]
    assert st["steps_counted"] == 2 and st["first_step_left_out"]
    for r in range(2):
        step, compute, halo, allreduce, wait = (st["per_rank"][name][r] for name in PARTS)
        assert min(compute, halo, allreduce, wait) >= 0, st
        assert halo > 0 and allreduce > 0 and compute > 0, st  # a split model exchanges and all-reduces
        assert compute + halo + allreduce + wait <= step * 1.001 + 1e-6, st
        assert step < 30, st  # seconds: a 16^3 step, not a sum over the run
    assert "time per step (mean of ranks, 2 steps, after the first)" in proc.stderr, proc.stderr[-3000:]

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if row["kind"] == "train"]
    assert len(train) == 3 and all(row["time_halo_exchange_s"] > 0 for row in train)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(run / "tb"))
    tb.Reload()
    for name in PARTS:
        assert len(tb.Scalars(f"train/time_{name}")) == 3, tb.Tags()["scalars"]

    for r in range(2):
        events = [e for e in _events(run / "profile" / f"rank{r}.json") if e.get("ph") == "X"]
        steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
        assert len(steps) == 1, [e["name"] for e in steps]  # one recorded step after the warm-up
        lo, hi = steps[0]["ts"], steps[0]["ts"] + steps[0]["dur"]
        for name in ("parallel.halo_exchange", "parallel.grad_allreduce"):
            found = [e for e in events if e["name"] == name and lo <= e["ts"] <= hi]
            assert found and all(e["dur"] >= 0 for e in found), (r, name)
