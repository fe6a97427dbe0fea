"""No silent hangs: when one rank fails, every rank stops, naming the rank that failed.

Each rank of a multi-process job runs a ``Watchdog``: a daemon thread with its own
connection to the job's key-value store (the ``TCPStore`` that torch.distributed's
rendezvous already runs: torchrun's agent, or rank 0 under mpirun and srun). Every
``interval_s`` it

- bumps this rank's heartbeat counter;
- looks for the job's abort record (the first failure anyone reported) and, if there is
  one, logs it and ends this process (``os._exit``), wherever the main thread is blocked;
- checks that the peers on its own host are still alive (their process ids) and that its
  ring neighbour (rank + 1) keeps beating; a peer dead or silent for ``timeout_s`` is
  reported as failed, which stops everyone;
- ends this process if the store itself has gone (its host, rank 0 or the launcher, died).

Under mpirun, a rank killed by a signal makes hydra SIGKILL every other rank at once, so
no rank can name it; the lowest rank of each node starts ``parallel/runtime/monitor.py``, a
small process outside the job's cleanup that names the rank that died first.

When the main thread fails (any exception), ``fail`` names the cause: a peer already
known to be dead or failed (a collective broken by a dead peer blames the peer, not this
rank), or this rank's own error. It publishes the record, logs one line, and ends the
job: ``MPI_Abort`` under MPI (mpirun does not stop the other ranks when one exits with an
error), ``os._exit(1)`` elsewhere (torchrun stops the others when one exits non-zero; the
peers' watchdogs stop them under srun or a manual launch). A collective that no peer
answers raises after ``parallel.timeout_s`` (the process group's timeout), so a hang
ends in a failure either way. See ``docs/failures.md``.

The job's abort record is JSON (``parallel.runtime.failures.Record``). The decisions (which peer
is dead or silent, whom a failure blames, what is published, which exit code) are pure
functions in ``parallel.runtime.failures``, tested without processes; the ``Watchdog`` gathers
the observations and carries the decisions out.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any, Iterator, NoReturn

import torch.distributed as dist

from parallel.runtime import monitor
from parallel.runtime.failures import EXIT_CODE, PeerCheck, Record, looks_like_comm, plan_failure, reaction

log = logging.getLogger("parallel")



def _process_state(pid: int) -> str | None:
    """The state letter of a local process (``R``, ``S``, ``Z``...), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return "?"
        return "?"


def _alive(pid: int) -> bool:
    state = _process_state(pid)
    return state is not None and state not in ("Z", "X")


class Watchdog:
    """The dead-peer detector and failure reporter of one rank (see the module docstring).

    Args:
        rank, world_size: this rank and the job's size.
        address: ``(host, port)`` of the job's TCPStore.
        timeout_s: a peer silent this long is declared dead.
        interval_s: heartbeat and polling period.
        launcher: ``mpi`` ends a failing job with ``MPI_Abort``.
        namespace: key prefix (one per launch attempt).
        monitor: start the node's death monitor (``parallel/runtime/monitor.py``; for mpirun).
    """

    def __init__(self, rank: int, world_size: int, address: tuple[str, int], timeout_s: float,
                 interval_s: float = 1.0, launcher: str = "", namespace: str = "watchdog",
                 monitor: bool | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.address = address
        self.timeout_s = float(timeout_s)
        self.interval_s = max(0.05, min(float(interval_s), self.timeout_s / 4))
        self.launcher = launcher
        self.ns = namespace.rstrip("/") + "/"
        self.host = socket.gethostname()
        self._store = self._connect()
        self._stop = threading.Event()
        self._failing = False
        self._thread: threading.Thread | None = None
        self._peers: dict[int, tuple[str, int]] = {}
        self._check = PeerCheck(rank, world_size, self.host, self.timeout_s)
        self._check.beat = (-1, time.monotonic())
        self._store_errors = 0
        self._lock = threading.Lock()  # one store connection, two threads
        self._busy_since: float | None = None  # when the store call in progress began
        self.monitor = launcher == "mpi" if monitor is None else monitor
        tag = re.sub(r"[^A-Za-z0-9]+", "-", f"{address[0]}-{address[1]}-{namespace}")
        self.notes = os.path.join(tempfile.gettempdir(), f"spatialcnn-exits-{tag}")
        self._monitor_link: Any = None  # kept open for the process's life (see parallel/runtime/monitor.py)
        self.before_exit: Any = None
        """Called (bounded by the caller) before this process ends the job: the training
        loop finishes a checkpoint write in flight, so a restart loses no finished copy."""

    # -- setup -------------------------------------------------------------------------
    def _connect(self) -> Any:
        host, port = self.address
        return dist.TCPStore(host, int(port), is_master=False,
                             timeout=timedelta(seconds=max(5.0, 5 * self.interval_s)))

    def _key(self, name: str) -> str:
        return self.ns + name

    def start(self) -> "Watchdog":
        """Register this rank (host, pid) and start the thread."""
        self._store.set(self._key(f"pid/{self.rank}"), f"{self.host} {os.getpid()}")
        self._store.add(self._key(f"hb/{self.rank}"), 1)
        if self.monitor:
            self._start_monitor()
            # The connection the monitor watches (it ends when this process's files close);
            # made in the background: the node's lowest rank may start the monitor later.
            threading.Thread(target=self._connect_monitor, name="parallel-monitor-link", daemon=True).start()
        self._thread = threading.Thread(target=self._run, name="parallel-watchdog", daemon=True)
        self._thread.start()
        threading.Thread(target=self._guard, name="parallel-watchdog-guard", daemon=True).start()
        return self

    @contextlib.contextmanager
    def _store_call(self) -> Iterator[None]:
        """One use of the store connection (by either thread), timed for ``_guard``."""
        with self._lock:
            self._busy_since = time.monotonic()
            try:
                yield
            finally:
                self._busy_since = None

    def _guard(self) -> None:
        """End this process when a store call hangs past ``timeout_s``: a store behind a
        link that went down answers nothing and raises nothing (TCP keeps waiting), so the
        heartbeat, and any thread waiting for the connection, would wait with it."""
        while not self._stop.wait(self.interval_s):
            since = self._busy_since
            if since is not None and time.monotonic() - since > self.timeout_s:
                host, port = self.address
                self._die(f"rank {self.rank}: stopping: lost the job's store at {host}:{port}: no answer for "
                          f"{time.monotonic() - since:.0f} s (parallel.timeout_s={self.timeout_s:g}): the "
                          "network to it is down, or its host died")

    def _start_monitor(self) -> None:
        local = [t for t in self.table() if t["host"] == self.host]
        if not local or min(t["rank"] for t in local) != self.rank:
            return
        os.makedirs(self.notes, exist_ok=True)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "monitor.py")
        # Its own session: the launcher's cleanup of the job's processes leaves it running
        # long enough to name the dead rank; no shell, arguments as a list.
        subprocess.Popen([sys.executable, script, self.notes, self.host,
                          *(f"{t['rank']}:{t['pid']}" for t in local)],
                         stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True)

    def _connect_monitor(self) -> None:
        self._monitor_link = monitor.connect(self.notes, self.rank, timeout=max(30.0, self.timeout_s))

    def note_exit(self, status: str) -> None:
        """Leave this rank's exit note for the node's monitor: ``ok`` (normal end),
        ``failed`` (reported its own error), ``stopping`` (stopped for a peer's failure)."""
        if not self.monitor:
            return
        try:
            os.makedirs(self.notes, exist_ok=True)
            with open(os.path.join(self.notes, str(self.rank)), "w", encoding="utf-8") as fh:
                fh.write(status)
        except OSError:
            pass

    def table(self) -> list[dict[str, Any]]:
        """Every rank's host and process id (waits until all have registered)."""
        out = []
        with self._lock:
            self._store.set_timeout(timedelta(seconds=self.timeout_s))  # peers may start late
            try:
                for r in range(self.world_size):
                    host, pid = self._store.get(self._key(f"pid/{r}")).decode().split()
                    out.append({"rank": r, "host": host, "pid": int(pid)})
            finally:
                self._store.set_timeout(timedelta(seconds=max(5.0, 5 * self.interval_s)))
        return out

    def stop(self) -> None:
        """Stop watching (a normal end); call on every rank before the final barrier."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, 3 * self.interval_s))
        self.note_exit("ok")

    # -- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._failing:
                return
            try:
                with self._store_call():
                    cause = self._poll()
                self._store_errors = 0
            except Exception as err:  # noqa: BLE001 - any store failure means the store is gone
                self._store_errors += 1
                if self._store_errors < 3 or self._stop.is_set() or self._failing:
                    continue
                host, port = self.address
                self._die(f"rank {self.rank}: stopping: lost the job's store at {host}:{port} "
                          f"(hosted by rank 0 or the launcher, which must have died): {err}")
            if cause is not None and not self._stop.is_set() and not self._failing:
                self._publish(cause)
                code, message = reaction(cause, self.rank)
                if message is None:
                    self._failing = True
                    self.note_exit("failed")
                    time.sleep(self.interval_s)  # this rank is raising the same error: let it report
                    self._before_exit()
                    _exit("", code)
                self._die(message)

    def _poll(self) -> Record | None:
        """One round: heartbeat, abort record, peers. The cause of a failure, or None."""
        self._store.add(self._key(f"hb/{self.rank}"), 1)
        record = self._abort_record()
        if record is not None:
            return record
        return self._dead_peer()

    def _abort_record(self) -> Record | None:
        key = self._key("abort")
        if self._store.check([key]):
            return Record.from_json(self._store.get(key).decode())
        return None

    def _peer(self, r: int) -> tuple[str, int] | None:
        if r not in self._peers:
            key = self._key(f"pid/{r}")
            if not self._store.check([key]):
                return None
            host, pid = self._store.get(key).decode().split()
            self._peers[r] = (host, int(pid))
        return self._peers[r]

    def _dead_peer(self) -> Record | None:
        """Observe the peers (who registered, whose process is alive here, the neighbour's
        heartbeat) and let ``PeerCheck`` decide."""
        for r in range(self.world_size):
            if r != self.rank:
                self._peer(r)
        count = None
        if self._check.neighbour != self.rank:
            count = int(self._store.add(self._key(f"hb/{self._check.neighbour}"), 0))
        cause = self._check(self._peers, _alive, count, time.monotonic())
        return Record(cause, rank=self.rank) if cause is not None else None

    # -- failing -------------------------------------------------------------------------
    def diagnose(self, wait_s: float = 0.0) -> Record | None:
        """A peer's failure already visible from here (waiting up to ``wait_s`` for one)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                with self._store_call():
                    cause = self._abort_record() or self._dead_peer()
            except Exception:  # noqa: BLE001
                host, port = self.address
                cause = Record(f"the job's store at {host}:{port} is gone (rank 0 or the launcher died)")
            if cause is not None or time.monotonic() >= deadline:
                return cause
            time.sleep(min(self.interval_s, 0.2))

    def _publish(self, record: Record) -> None:
        """Make ``record`` the job's abort record unless another rank's came first."""
        try:
            with self._store_call():
                self._store.compare_set(self._key("abort"), "", record.to_json())
        except Exception:  # noqa: BLE001 - the store may be gone; the exit still happens
            pass

    @staticmethod
    def blames_peer(exc: BaseException) -> bool:
        """Whether ``exc`` looks like a broken collective (a peer's failure, not ours)."""
        return looks_like_comm(exc)

    def fail(self, exc: BaseException, own_error: bool = False, code: int = EXIT_CODE,
             collective: bool = False) -> NoReturn:
        """Report this rank's failure (or the peer's that caused it) and end the job.

        ``own_error``: the exception is this rank's own (bad input, a bug), so no peer is
        blamed for it; otherwise a communication error waits briefly for a peer's cause.
        ``collective``: every rank raises the same error at the same point (a pre-flight
        check), so only rank 0 reports it and the ranks exit with ``code`` by themselves.
        """
        self._failing = True
        cause = None
        if not own_error and not collective:
            wait = min(self.timeout_s, 10 * self.interval_s) if looks_like_comm(exc) else 0.0
            cause = self.diagnose(wait)
        plan = plan_failure(self.rank, exc, own_error, code, collective, cause)
        self.note_exit(plan.note)
        if plan.publish is not None:
            self._publish(plan.publish)
        if plan.message is not None:
            log.error("%s", plan.message)
        # Let the peers' watchdogs read the record before this rank (maybe the store's
        # host) goes away.
        time.sleep(min(2 * self.interval_s, 2.0))
        self._before_exit()
        _exit(self.launcher if plan.abort else "", plan.code)

    def _die(self, message: str) -> NoReturn:
        self._failing = True
        self.note_exit("stopping")
        log.error("%s", message)
        self._before_exit()
        _exit(self.launcher, EXIT_CODE)

    def _before_exit(self) -> None:
        if self.before_exit is not None:
            try:
                self.before_exit()
            except Exception as err:  # noqa: BLE001 - the exit must happen
                log.warning("rank %d: before exiting: %s", self.rank, err)


def _exit(launcher: str, code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    for handler in logging.getLogger("parallel").handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001
            pass
    if launcher == "mpi":
        try:
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(code)
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)
