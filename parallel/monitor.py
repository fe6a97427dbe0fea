"""A node's death monitor: names a rank that was killed when the launcher kills the rest.

mpirun (MPICH's hydra) answers a rank killed by a signal by killing every other rank at
once with SIGKILL, so no rank lives long enough to say which one died, and hydra's own
message quotes some process id of the job, not necessarily the dead one. The lowest rank
on each node therefore starts this small process in its own session (so the launcher's
cleanup does not take it down), with the node's ranks and process ids. It waits for the
first of them to end; a rank that ended without leaving an exit note (``ok`` at a normal
end, ``failed`` after reporting its own error, ``stopping`` after stopping for a peer's
failure) was killed or crashed, and the monitor says so on the job's stderr, with the
time. With several nodes, every node's monitor sees its ranks end (the dead one, or the
launcher's cleanup); the earliest time names the rank that died first. Then it exits.
It imports nothing heavy (it runs as a script).

    python parallel/monitor.py NOTES_DIR HOST RANK:PID [RANK:PID ...]
"""

from __future__ import annotations

import os
import select
import shutil
import sys
import time


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _note(notes: str, rank: int) -> str | None:
    try:
        with open(os.path.join(notes, str(rank)), encoding="utf-8") as fh:
            return fh.read().strip() or "ok"
    except OSError:
        return None


def _any_reported(notes: str) -> bool:
    """Whether a rank already reported a failure of its own (a rank that is only stopping for
    a peer may be killed by the launcher before it can name the peer: name it here too)."""
    try:
        names = os.listdir(notes)
    except OSError:
        return False
    return any(_note(notes, int(n)) == "failed" for n in names if n.isdigit())


def _wait_first(pids: dict[int, int]) -> list[int]:
    """Block until at least one of the ranks' processes ends; the ranks that ended."""
    ended = [r for r, p in pids.items() if _gone(p)]
    if ended:
        return ended
    try:
        fds = {os.pidfd_open(p): r for r, p in pids.items()}
    except (AttributeError, OSError):
        fds = {}
    if fds:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        ready = poller.poll()
        for fd in fds:
            os.close(fd)
        return [fds[fd] for fd, _ in ready]
    while True:  # no pidfd: poll /proc
        time.sleep(0.02)
        ended = [r for r, p in pids.items() if _gone(p)]
        if ended:
            return ended


def main(argv: list[str]) -> int:
    notes, host, *entries = argv
    pids = {int(r): int(p) for r, p in (e.split(":") for e in entries)}
    try:
        os.makedirs(notes, exist_ok=True)
        while pids:
            ended = _wait_first(pids)
            when = time.time()
            time.sleep(0.3)  # a rank writes its note just before it exits
            if _any_reported(notes):
                return 0  # a rank reported its own failure: the deaths that follow are the cleanup
            for r in sorted(ended):
                if _note(notes, r) is None:
                    stamp = time.strftime("%H:%M:%S", time.localtime(when)) + f".{int(when % 1 * 1000):03d}"
                    sys.stderr.write(
                        f"parallel monitor on {host}: rank {r} (process {pids[r]}) died without reporting "
                        f"an error (killed by a signal or crashed) at {stamp}; the job is stopped\n")
                    sys.stderr.flush()
                    return 1
                pids.pop(r)
        return 0
    finally:
        shutil.rmtree(notes, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
