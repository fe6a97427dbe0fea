"""The node's death monitor (parallel/runtime/monitor.py) names the rank that died first when a
launcher answers that death by killing the rest at once, as MPICH's hydra does.

Real processes: children with several threads (as ranks have) connect to a real monitor;
a stand-in for hydra's proxy here is ten lines that read the children's stdout pipes and
SIGKILL every other child the moment one pipe ends, which is hydra's reaction.
"""

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MONITOR = REPO / "parallel" / "runtime" / "monitor.py"
# A stand-in rank: the monitor's client side, loaded from its file (it needs only the
# standard library; through the package, every stand-in would import torch first)
RANK = """
import importlib.util, threading, time
spec = importlib.util.spec_from_file_location("monitor", {path!r})
monitor = importlib.util.module_from_spec(spec)
spec.loader.exec_module(monitor)
for _ in range(6):
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
print("up", flush=True)
link = monitor.connect({notes!r}, {rank}, timeout=60)
print("linked" if link else "no monitor", flush=True)
time.sleep(600)
"""


def _launch(notes: Path, n: int) -> tuple[list[subprocess.Popen], subprocess.Popen]:
    """``n`` ranks and their monitor, every rank connected to it."""
    ranks = [subprocess.Popen([sys.executable, "-c", RANK.format(path=str(MONITOR), notes=str(notes), rank=r)],
                              stdout=subprocess.PIPE, stdin=subprocess.DEVNULL) for r in range(n)]
    for p in ranks:
        assert p.stdout.readline().strip() == b"up"
    mon = subprocess.Popen([sys.executable, str(MONITOR), str(notes), "host",
                            *(f"{r}:{p.pid}" for r, p in enumerate(ranks))],
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    for p in ranks:
        assert p.stdout.readline().strip() == b"linked"
    return ranks, mon


def _end(ranks: list[subprocess.Popen], mon: subprocess.Popen) -> None:
    for p in [*ranks, mon]:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def _hydra_cleanup(ranks: list[subprocess.Popen], limit: float = 30.0) -> None:
    """Wait for one rank's stdout to end, then SIGKILL the others at once."""
    poller = select.poll()
    for p in ranks:
        poller.register(p.stdout.fileno(), select.POLLIN | select.POLLHUP)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        for fd, _ in poller.poll(100):
            if not os.read(fd, 4096):
                for p in ranks:
                    if p.stdout.fileno() != fd and p.poll() is None:
                        p.send_signal(signal.SIGKILL)
                return
    raise AssertionError("no rank ended")


@pytest.mark.parametrize("trial", range(3))
def test_the_killed_rank_is_named_though_the_launcher_kills_the_rest_at_once(tmp_path, trial):
    notes = tmp_path / "notes"
    ranks, mon = _launch(notes, 4)
    try:
        victim = 1 + trial % 3
        ranks[victim].send_signal(signal.SIGKILL)
        _hydra_cleanup(ranks)
        _, err = mon.communicate(timeout=30)
    finally:
        _end(ranks, mon)
    assert mon.returncode == 1, err
    named = re.findall(r"rank (\d) \(process (\d+)\)", err)
    assert (str(victim), str(ranks[victim].pid)) in named, err
    assert len(named) == 1 or "ended at the same moment" in err, err
    assert not notes.exists(), "the monitor left its notes directory"


def test_ranks_that_end_with_their_note_are_not_reported(tmp_path):
    notes = tmp_path / "notes"
    ranks, mon = _launch(notes, 2)
    try:
        for r, p in enumerate(ranks):
            (notes / str(r)).write_text("ok")
            p.send_signal(signal.SIGKILL)
        _, err = mon.communicate(timeout=30)
    finally:
        _end(ranks, mon)
    assert mon.returncode == 0 and "died" not in err and "ended" not in err, err


def _load_monitor():
    import importlib.util

    spec = importlib.util.spec_from_file_location("monitor_under_test", MONITOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_connection_closed_before_its_process_is_gone_is_seen_with_a_later_death(tmp_path):
    """The order a busy node can show: the killed rank (1) has closed its files, its
    connection, but is not yet a zombie, while a rank the launcher killed after it (2) has
    already gone. Both are named in that wake, not only the one /proc shows gone."""
    monitor = _load_monitor()
    notes = str(tmp_path / "notes")
    os.makedirs(notes)
    procs = {r: subprocess.Popen(["sleep", "120"]) for r in (1, 2, 3)}
    watch = monitor._Watch(notes, {r: p.pid for r, p in procs.items()})
    try:
        first, third = monitor.connect(notes, 1, timeout=10), monitor.connect(notes, 3, timeout=10)
        third.close()  # rank 3 ends first: the wake in which rank 1's connection is read too
        assert watch.wait() == [3]
        watch.forget(3)
        first.close()  # rank 1: its connection closed, its process still there
        procs[2].kill()
        procs[2].wait()  # rank 2: gone from /proc
        assert watch.wait() == [1, 2]
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
