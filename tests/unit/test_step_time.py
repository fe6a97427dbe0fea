"""Where a step's time goes (``parallel/train/observe/profile.py``): the clock's own rules,
without processes: only the outermost region counts, the halo helper thread's regions do
not, the parts are disjoint and add up to the step, the first step left out. (A late rank
on 2 ranks: tests/ranks/test_step_time_ranks.py; what a user sees:
tests/launch/test_step_time_summary.py.)"""

import threading
import time

import pytest
import torch

from parallel.comm import timing
from parallel.train.observe.steptime import StepTimes, format_line, summary_fields


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
