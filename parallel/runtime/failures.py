"""What the watchdog decides when something fails, as pure functions of what it observed.

- ``Record``: the job's abort record (the first failure any rank reported), JSON in the
  job's store: the message every rank logs, the exit code, whether every rank raised it
  alike (``collective``) and who published it.
- ``PeerCheck``: a peer on this host whose process is gone is dead; the ring neighbour
  whose heartbeat has not moved for ``timeout_s`` is silent (dead elsewhere, or hung).
- ``looks_like_comm``: an exception that looks like a broken collective blames a peer.
- ``plan_failure``: what a failing rank logs, publishes and exits with.
- ``reaction``: what a rank does on seeing the job's abort record.

``parallel.runtime.watchdog`` observes (the store, ``/proc``, the clock) and acts (logs, exits).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Callable, Mapping

import torch.distributed as dist

EXIT_CODE = 1
"""The exit status of a rank that fails or stops for a peer (a collective failure has its own)."""
_COMM_HINTS = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout",
               "socket", "gloo", "nccl", "peer", "recv", "send")


@dataclass(frozen=True)
class Record:
    """The job's abort record: the first failure any rank reported, as JSON in the store."""

    message: str
    """What failed and where, as every rank logs it (``rank 3 failed: ValueError: ...``)."""
    code: int = EXIT_CODE
    """The exit status of a collective failure (every rank ends with it)."""
    collective: bool = False
    """Every rank raised the same error at the same point (a pre-flight check): each
    rank exits by itself with ``code``, and only rank 0 reports it."""
    rank: int | None = None
    """The rank that published it."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Record":
        """The record in ``text``; text that is not a record is kept whole as its message."""
        try:
            data = json.loads(text)
            return cls(str(data["message"]), int(data.get("code", EXIT_CODE)), bool(data.get("collective", False)),
                       data.get("rank"))
        except (ValueError, TypeError, KeyError, AttributeError):
            return cls(text)


class PeerCheck:
    """Decides, from one round of observations, whether a peer is dead or silent.

    A peer on this host whose process is gone is dead; the ring neighbour (rank + 1)
    whose heartbeat counter has not moved for ``timeout_s`` is silent.
    """

    def __init__(self, rank: int, world_size: int, host: str, timeout_s: float) -> None:
        self.rank, self.world_size, self.host, self.timeout_s = rank, world_size, host, timeout_s
        self.beat = (-1, 0.0)  # the neighbour's last counter and when it changed

    @property
    def neighbour(self) -> int:
        return (self.rank + 1) % self.world_size

    def __call__(self, peers: Mapping[int, tuple[str, int]], alive: Callable[[int], bool],
                 neighbour_count: int | None, now: float) -> str | None:
        """The cause of a failure, or None. ``peers``: rank -> (host, pid) of the ranks
        registered so far; ``alive(pid)`` for processes on this host;
        ``neighbour_count``: the neighbour's heartbeat counter now (None: no neighbour)."""
        for r in range(self.world_size):
            peer = peers.get(r)
            if r != self.rank and peer is not None and peer[0] == self.host and not alive(peer[1]):
                return f"rank {r} died (process {peer[1]} on {peer[0]} is gone)"
        if neighbour_count is None:
            return None
        if neighbour_count != self.beat[0]:
            self.beat = (neighbour_count, now)
        elif now - self.beat[1] > self.timeout_s:
            peer = peers.get(self.neighbour)
            where = f" (process {peer[1]} on {peer[0]})" if peer else ""
            return (f"rank {self.neighbour}{where} sent no heartbeat for {now - self.beat[1]:.0f} s "
                    f"(parallel.timeout_s={self.timeout_s:g}): it died or hangs")
        return None


@dataclass(frozen=True)
class FailurePlan:
    """What a failing rank does: log ``message``, publish ``publish`` (if any), leave the
    exit note ``note``, and exit with ``code`` (``abort``: through the launcher's abort)."""

    message: str | None
    publish: Record | None
    note: str
    code: int
    abort: bool


def plan_failure(rank: int, exc: BaseException, own_error: bool, code: int, collective: bool,
                 cause: Record | None) -> FailurePlan:
    """The decision of ``Watchdog.fail`` (see there); ``cause``: a peer's failure already
    visible from this rank (looked for only when the error is not this rank's own)."""
    text = f"{type(exc).__name__}: {exc}".strip()
    first = text.splitlines()[0] if text else ""
    if collective:
        message = (str(exc) if own_error else f"rank {rank} failed: {text}") if rank == 0 else None
        return FailurePlan(message, Record(f"rank {rank} failed: {first[:2000]}", code, True, rank), "failed", code,
                           False)
    if cause is not None:
        return FailurePlan(f"rank {rank}: stopping: {cause.message} (here: {first[:300]})", None, "stopping", code,
                           True)
    return FailurePlan(f"rank {rank} failed: {text}", Record(f"rank {rank} failed: {first[:2000]}", code, False, rank),
                       "failed", code, True)


def reaction(record: Record, rank: int) -> tuple[int, str | None]:
    """How a rank's thread reacts to the job's abort record: (exit code, message to log).
    A collective record: this rank is raising the same error, so it exits quietly with
    the record's code; any other: it stops, saying why."""
    if record.collective:
        return record.code, None
    return EXIT_CODE, f"rank {rank}: stopping: {record.message}"


def looks_like_comm(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a broken collective (a peer's failure, not this rank's)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(h in text for h in _COMM_HINTS)
