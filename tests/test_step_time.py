"""Where a step's time goes (issue 24, Deliver 5): the per-step breakdown into compute, halo
exchange, gradient all-reduce and data waiting, in the summary, metrics.jsonl and TensorBoard,
and ``train.profile=N``'s per-rank traces naming the exchange and the all-reduce.

The clock's own rules (only the outermost region counts, the halo helper thread's regions
do not, the parts are disjoint) are checked without processes; on 2 ranks, a late rank's
neighbour counts its wait where it waits (the halo exchange, blocking or overlapped, or
the gradient all-reduce); a 2-rank run of a 16^3 CosmoFlow checks what a user sees."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

import steptime_cases
from parallel.comm import timing
from parallel.train.observe.steptime import PARTS, StepTimes, format_line, summary_fields
from train_helpers import launch, prepare


def test_regions_count_once_and_not_on_the_halo_thread():
    clock = timing.StepClock(torch.device("cpu"))
    clock.start()
    with timing.region(timing.HALO):
        time.sleep(0.02)
        with timing.region(timing.ALLREDUCE):  # nested: inside the outer region's time already
            time.sleep(0.05)

    def helper() -> None:
        timing.mark_background_thread()
        with timing.region(timing.HALO):  # overlapped with the step: not the step's time
            time.sleep(0.05)

    t = threading.Thread(target=helper)
    t.start()
    t.join()
    with timing.region(timing.ALLREDUCE):
        time.sleep(0.01)
    got = clock.stop()
    assert 0.07 <= got[timing.HALO] < 0.115, got  # the outer region with what it holds; the helper's not at all
    assert 0.01 <= got[timing.ALLREDUCE] < 0.05, got  # the nested one not counted again (that would be 0.06)
    with timing.region(timing.HALO):  # no step running: nothing counted anywhere
        time.sleep(0.001)
    assert clock.totals == got


def test_the_parts_add_up_to_the_step_and_the_first_is_left_out():
    times = StepTimes(torch.device("cpu"))
    for k in range(3):
        with times.step(data_wait_s=0.01):
            time.sleep(0.03 if k else 0.1)  # the first step: a slow warm-up
            with timing.region(timing.HALO):
                time.sleep(0.02)
    means = times.session_means()
    assert means[:2] == [2.0, 1.0]  # two steps counted, the first left out
    step, compute, halo, allreduce, wait = means[2:]
    assert step < 0.09 and halo >= 0.02 and allreduce == 0.0 and wait == pytest.approx(0.01)
    assert compute + halo + allreduce + wait == pytest.approx(step)
    fields = summary_fields(torch.tensor([means, means], dtype=torch.float64))
    assert fields["step_time"]["mean"]["halo_exchange_s"] == pytest.approx(halo, abs=1e-6)
    assert "halo exchange and waiting" in format_line(fields)


@pytest.mark.ranks
@pytest.mark.parametrize("spatial,late_before,overlap,kind", [
    ((2, 1, 1), "forward", False, timing.HALO),        # split: the first halo exchange waits for the late rank
    ((2, 1, 1), "forward", True, timing.HALO),         # overlapped: the wait for the halo thread's result
    ((1, 1, 1), "backward", False, timing.ALLREDUCE),  # 2 data groups: the gradient all-reduce waits
], ids=["split-halo-wait", "split-overlapped-halo-wait", "data-allreduce-wait"])
def test_a_late_rank_is_waited_for_where_it_happens(pools, spatial, late_before, overlap, kind):
    on = pools.run(2, steptime_cases.late_rank_waits, late_before, overlap, spatial=spatial)
    other = timing.ALLREDUCE if kind == timing.HALO else timing.HALO
    assert on[0][kind] >= 0.75 * steptime_cases.LATE_S, on  # rank 0 waited there for rank 1
    assert on[1][kind] < 0.75 * steptime_cases.LATE_S, on   # the late rank did not wait
    assert on[0][other] < 0.5 * steptime_cases.LATE_S, on   # nor was the wait put elsewhere


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare("cosmoflow", tmp_path_factory.mktemp("cosmo16"), 16, 8, 4)


def _events(trace: Path) -> list[dict]:
    raw = json.loads(trace.read_text())
    return raw["traceEvents"] if isinstance(raw, dict) else raw


@pytest.mark.launch
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
