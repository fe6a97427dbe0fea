"""The watchdog's decisions, without processes: the JSON abort record, which peer is dead
or silent, whom a failure blames, what a failing rank publishes and which exit code every
rank ends with. (Real jobs with a killed or failing rank: ``test_fail_ranks.py``.)"""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from parallel.runtime.failures import EXIT_CODE, PeerCheck, Record, looks_like_comm, plan_failure, reaction


def test_the_abort_record_is_json_and_round_trips():
    record = Record("rank 3 failed: ValueError: bad", code=2, collective=True, rank=3)
    text = record.to_json()
    assert json.loads(text) == {"message": "rank 3 failed: ValueError: bad", "code": 2, "collective": True, "rank": 3}
    assert Record.from_json(text) == record
    # Text that is not a record (a store written by something else) is kept as the message.
    assert Record.from_json("rank 1 failed: boom") == Record("rank 1 failed: boom")
    assert Record.from_json('{"no": "message"}').message == '{"no": "message"}'


def _alive_except(*dead: int):
    return lambda pid: pid not in dead


def test_a_dead_peer_on_this_host_is_named_by_rank_and_process():
    check = PeerCheck(rank=0, world_size=4, host="a", timeout_s=10)
    peers = {0: ("a", 100), 1: ("a", 101), 2: ("a", 102), 3: ("b", 103)}
    assert check(peers, _alive_except(), 5, now=0.0) is None
    assert check(peers, _alive_except(102), 6, now=1.0) == "rank 2 died (process 102 on a is gone)"
    # A process on another host cannot be looked up: only its heartbeat tells.
    assert check(peers, _alive_except(103), 7, now=2.0) is None
    # This rank's own process is never a peer.
    assert check(peers, _alive_except(100), 8, now=3.0) is None


def test_a_silent_neighbour_is_reported_after_the_timeout_only():
    check = PeerCheck(rank=2, world_size=3, host="a", timeout_s=10)
    assert check.neighbour == 0  # the ring wraps
    peers = {0: ("b", 7), 1: ("a", 8), 2: ("a", 9)}
    alive = _alive_except()
    assert check(peers, alive, 4, now=100.0) is None
    assert check(peers, alive, 5, now=105.0) is None  # it beats: the clock restarts
    assert check(peers, alive, 5, now=115.0) is None  # silent for exactly the timeout: not yet
    assert check(peers, alive, 5, now=115.5) == ("rank 0 (process 7 on b) sent no heartbeat for 10 s "
                                                 "(parallel.timeout_s=10): it died or hangs")
    assert check(peers, alive, 6, now=116.0) is None  # it came back
    unregistered = PeerCheck(rank=2, world_size=3, host="a", timeout_s=1)
    unregistered(peers={}, alive=alive, neighbour_count=0, now=0.0)
    assert unregistered({}, alive, 0, now=2.0) == ("rank 0 sent no heartbeat for 2 s (parallel.timeout_s=1): "
                                                   "it died or hangs")
    assert PeerCheck(0, 1, "a", 1)({}, alive, None, now=99.0) is None  # a world of one has no neighbour


@pytest.mark.parametrize("exc, comm", [
    (RuntimeError("[gloo] Connection reset by peer"), True),
    (RuntimeError("Timed out waiting 600000ms for recv operation"), True),
    (dist.DistError("anything"), True),
    (RuntimeError("CUDA out of memory"), False),
    (ValueError("bad config: send"), False),  # only a runtime error is a broken collective
], ids=["reset", "timeout", "dist-error", "oom", "value-error"])
def test_broken_collectives_blame_a_peer(exc, comm):
    assert looks_like_comm(exc) is comm


def test_an_own_error_is_published_and_ends_the_job_through_the_launcher():
    plan = plan_failure(3, ValueError("data/s7.h5: field 'volume'\nmore"), own_error=True, code=2,
                        collective=False, cause=None)
    assert plan.message == "rank 3 failed: ValueError: data/s7.h5: field 'volume'\nmore"
    assert plan.publish == Record("rank 3 failed: ValueError: data/s7.h5: field 'volume'", 2, False, 3)
    assert (plan.note, plan.code, plan.abort) == ("failed", 2, True)


def test_a_broken_collective_blames_the_peer_that_failed_first():
    cause = Record("rank 1 died (process 4711 on n7 is gone)", rank=0)
    plan = plan_failure(2, RuntimeError("Connection closed by peer"), own_error=False, code=EXIT_CODE,
                        collective=False, cause=cause)
    assert plan.message == ("rank 2: stopping: rank 1 died (process 4711 on n7 is gone) "
                            "(here: RuntimeError: Connection closed by peer)")
    assert plan.publish is None and plan.note == "stopping" and plan.code == EXIT_CODE
    # No cause found: the rank reports its own failure.
    alone = plan_failure(2, RuntimeError("Connection closed by peer"), False, EXIT_CODE, False, None)
    assert alone.publish is not None and alone.publish.message.startswith("rank 2 failed: RuntimeError")


def test_a_collective_failure_is_reported_once_and_every_rank_exits_with_its_code():
    exc = ValueError("3 problem(s) in the sample files")
    first = plan_failure(0, exc, own_error=True, code=2, collective=True, cause=None)
    other = plan_failure(1, exc, own_error=True, code=2, collective=True, cause=None)
    assert first.message == "3 problem(s) in the sample files" and other.message is None
    assert first.publish == Record("rank 0 failed: ValueError: 3 problem(s) in the sample files", 2, True, 0)
    assert (first.code, first.abort, other.code, other.abort) == (2, False, 2, False)
    # Each rank's thread, seeing the record, exits quietly with its code ...
    assert reaction(first.publish, 1) == (2, None)
    # ... while any other record stops the rank, saying why, with the failure exit code.
    assert reaction(Record("rank 3 failed: ValueError: x", 2, False, 3), 0) == (
        EXIT_CODE, "rank 0: stopping: rank 3 failed: ValueError: x")
