"""``train.profile=N``: a ``torch.profiler`` trace of N training steps, one file per rank.

The first step of the session is the profiler's warm-up (and the run's: first-touch
allocations, the halo plans), then N steps are recorded and each rank writes
``run.dir/profile/rank<r>.json``, a Chrome trace that opens in Perfetto
(https://ui.perfetto.dev) or chrome://tracing. The halo exchange and the gradient
all-reduce show up by name (``parallel.halo_exchange``, ``parallel.halo_exchange_wait``,
``parallel.grad_allreduce``: ``parallel.comm.timing``), beside each step
(``ProfilerStep#k``) and the operators. ``scripts/trace_png.py`` draws a trace as a
picture. Profiling slows the recorded steps (the step-time breakdown of those steps
includes its overhead).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from parallel.train.observe.events import Observer

log = logging.getLogger("parallel.train")


def trace_path(run_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank`` writes its trace."""
    return Path(run_dir) / "profile" / f"rank{rank}.json"


class StepProfiler(Observer):
    """An observer of the run: ``step()`` after every training step; ``close()`` at the end
    (writes a trace cut short)."""

    def __init__(self, steps: int, run_dir: str, rank: int, device: torch.device) -> None:
        self.path = trace_path(run_dir, rank)
        self.steps, self.seen, self.written = steps, 0, False
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof: Any = torch.profiler.profile(
            activities=activities, schedule=torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1),
            on_trace_ready=self._write)
        self.prof.start()

    def _write(self, prof: Any) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        self.written = True
        log.info("train.profile: a trace of %d step(s) in %s (opens in https://ui.perfetto.dev)",
                 max(self.seen - 1, 0), self.path)

    def step(self) -> None:
        self.seen += 1
        if self.prof is not None:
            self.prof.step()
            if self.written:  # done: the rest of the run goes unprofiled
                self.prof.stop()
                self.prof = None

    def close(self) -> None:
        if self.prof is None:
            return
        if self.seen < self.steps + 1:
            log.warning("train.profile=%d: the session ran %d step(s) (a warm-up step and %d to record); the trace "
                        "holds what ran", self.steps, self.seen, self.steps)
        self.prof.stop()  # a recording cut short is written by the profiler's trace handler
        self.prof = None

    def step_end(self, progress: Any, loss: Any, stats: Any) -> None:
        self.step()

    def run_end(self, end: Any) -> None:
        self.close()
