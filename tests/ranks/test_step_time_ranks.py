"""Where a step's time goes, on 2 ranks: a late rank's neighbour counts its wait where it
waits (the halo exchange, blocking or overlapped, or the gradient all-reduce)."""

import pytest

import steptime_cases
from parallel.comm import timing


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
