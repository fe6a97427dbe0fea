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

When a rank ended is seen at the moment the launcher sees it: every rank keeps a
connection to the monitor (an abstract Unix socket, ``address(notes)``), which the kernel
closes as it closes the rank's files, the same step in which hydra's pipes from that rank
reach their end and hydra starts the cleanup. A dead rank's connection therefore ends
before any rank the cleanup kills can end. (A process's pidfd becomes readable only after
its last thread has gone, a little later; it is kept for ranks that did not connect.) When
the monitor could not run before several connections had ended, it cannot tell their order
and names them all. It imports nothing heavy (it runs as a script).

    python parallel/runtime/monitor.py NOTES_DIR HOST RANK:PID [RANK:PID ...]
"""

from __future__ import annotations

import hashlib
import os
import select
import shutil
import socket
import sys
import time


def address(notes: str) -> str:
    """The monitor's abstract socket name for a notes directory (Linux; no file to clean)."""
    return "\0spatialcnn-monitor-" + hashlib.sha1(notes.encode()).hexdigest()[:20]


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


class _Watch:
    """The ranks' connections and pidfds in one poll set."""

    def __init__(self, notes: str, pids: dict[int, int]) -> None:
        self.pids = pids
        self.poller = select.poll()
        self.entries: dict[int, tuple[str, int | None, socket.socket | None]] = {}  # fd -> kind, rank, socket
        self.listener: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.listener.bind(address(notes))
            self.listener.listen(len(pids) + 4)
            self._add("listen", None, self.listener)
        except OSError:  # another monitor for these notes: pidfds alone
            self.listener.close()
            self.listener = None
        for r, p in pids.items():
            try:
                fd = os.pidfd_open(p)
            except (AttributeError, OSError):
                continue  # no pidfd (old kernel) or already gone: /proc is read on every wake
            self.entries[fd] = ("pidfd", r, None)
            self.poller.register(fd, select.POLLIN)

    def _add(self, kind: str, rank: int | None, sock: socket.socket) -> None:
        self.entries[sock.fileno()] = (kind, rank, sock)
        self.poller.register(sock.fileno(), select.POLLIN)

    def _drop(self, fd: int) -> None:
        _, _, sock = self.entries.pop(fd)
        self.poller.unregister(fd)
        if sock is not None:
            sock.close()
        else:
            os.close(fd)

    def forget(self, rank: int) -> None:
        """Stop watching a rank that ended with its note."""
        for fd in [fd for fd, (kind, r, _) in self.entries.items() if r == rank]:
            self._drop(fd)

    def wait(self) -> list[int]:
        """Block until at least one rank has ended; the ranks seen ended in this wake."""
        while True:
            ended = {r for r, p in self.pids.items() if _gone(p)}
            # the connections are read even when /proc already shows a rank gone: a killed rank
            # closes its files (its connection) before it becomes a zombie, and a rank the
            # launcher killed after it can finish exiting first on a busy node
            events = self.poller.poll(0 if ended else (None if self.entries else 20))
            for fd, _ in events:
                if fd not in self.entries:
                    continue
                kind, rank, sock = self.entries[fd]
                if kind == "listen":
                    conn, _ = sock.accept()
                    self._add("new", None, conn)
                elif kind == "pidfd":
                    ended.add(rank)
                else:
                    data = sock.recv(64)
                    if kind == "new" and data.strip().isdigit() and int(data) in self.pids:
                        self.entries[fd] = ("conn", int(data), sock)
                    elif not data:  # the rank's files were closed: it is ending
                        if rank is not None:
                            ended.add(rank)
                        self._drop(fd)
            ended &= set(self.pids)
            if ended:
                return sorted(ended)


def connect(notes: str, rank: int, timeout: float = 30.0) -> socket.socket | None:
    """A rank's connection to its node's monitor (kept open until the process ends); None
    when no monitor answered within ``timeout`` (its pidfd still watches the rank)."""
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(address(notes))
            sock.sendall(f"{rank}\n".encode())
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)


def _stamp(when: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(when)) + f".{int(when % 1 * 1000):03d}"


def main(argv: list[str]) -> int:
    notes, host, *entries = argv
    pids = {int(r): int(p) for r, p in (e.split(":") for e in entries)}
    try:
        os.makedirs(notes, exist_ok=True)
        watch = _Watch(notes, pids)
        while pids:
            ended = watch.wait()
            when = time.time()
            time.sleep(0.3)  # a rank writes its note just before it exits
            if _any_reported(notes):
                return 0  # a rank reported its own failure: the deaths that follow are the cleanup
            silent = [r for r in ended if _note(notes, r) is None]
            if len(silent) == 1:
                r = silent[0]
                sys.stderr.write(
                    f"parallel monitor on {host}: rank {r} (process {pids[r]}) died without reporting "
                    f"an error (killed by a signal or crashed) at {_stamp(when)}; the job is stopped\n")
            elif silent:
                named = " and ".join(f"rank {r} (process {pids[r]})" for r in silent)
                sys.stderr.write(
                    f"parallel monitor on {host}: {named} ended at the same moment without reporting an "
                    f"error at {_stamp(when)}: one was killed by a signal or crashed and the launcher "
                    f"stopped the rest before this monitor could tell which came first; the job is stopped\n")
            if silent:
                sys.stderr.flush()
                return 1
            for r in ended:
                pids.pop(r)
                watch.forget(r)
        return 0
    finally:
        shutil.rmtree(notes, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
