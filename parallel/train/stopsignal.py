"""A signal that asks a run to checkpoint and stop: Slurm's warning before a time limit.

A batch job submitted with ``--signal=B:USR1@120`` receives SIGUSR1 two minutes before
its limit; ``scripts/run.sub`` passes it on to its tasks and sets ``run.stop_signal=USR1``.
The handler only records the request. At each step boundary every rank asks whether any
rank has one (a one-number all-reduce on the grid's CPU group: ranks receive the signal at
slightly different moments, and must stop after the same step), and if so the trainer
writes its checkpoint and ends the run; a resubmission with ``train.resume=true`` goes on
from that step and ends with the weights of an uninterrupted run.

Off (``run.stop_signal=null``, the default), nothing is installed and no step pays for
the check.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import torch

from parallel import comm

log = logging.getLogger("parallel.train")


def signal_number(name: str) -> signal.Signals:
    """``USR1``, ``SIGUSR1`` or ``10`` as a signal; a clear error naming the key otherwise."""
    text = str(name).strip().upper()
    try:
        return signal.Signals(int(text)) if text.isdigit() else signal.Signals[
            text if text.startswith("SIG") else f"SIG{text}"]
    except (KeyError, ValueError):
        raise ValueError(f"run.stop_signal={name!r} is not a signal name (e.g. USR1, TERM)") from None


class StopRequest:
    """Records the signal on this rank; ``due()`` tells every rank alike whether to stop."""

    def __init__(self, name: str, grid: Any) -> None:
        self.signum = signal_number(name)
        self.group = getattr(grid, "cpu_group", None)
        self.received = False
        self.step: int | None = None
        self._previous = signal.signal(self.signum, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:  # noqa: ARG002 - signal handler signature
        self.received = True

    def due(self) -> bool:
        """Whether any rank has received the signal (collective over the CPU group)."""
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int64)
        return bool(comm.all_reduce_(flag, self.group, "max", caller="stopsignal.due")[0])

    def close(self) -> None:
        """Put the previous handler back."""
        signal.signal(self.signum, self._previous)


def arm(name: str | None, grid: Any) -> StopRequest | None:
    """The run's stop request for ``run.stop_signal`` (None when off)."""
    if not name:
        return None
    request = StopRequest(name, grid)
    log.info("run.stop_signal=%s: on that signal the run writes a checkpoint after the current step and stops "
             "(resume with train.resume=true)", request.signum.name)
    return request
