"""The benchmarks' device: synchronised timers, and its memory as ``parallel.runtime.memory``
reads it (``in_use_bytes``, ``reset_peak``, ``peak_held_bytes``: on CUDA the reserved
bytes plus the context).

CPU: wall-clock timers. CUDA: kernels run asynchronously, so every timed region starts
and ends with ``torch.cuda.synchronize``. Nothing here has run on a GPU yet (none was
available): the CUDA branches follow the documented torch.cuda API and are exercised by
``scripts/gpu_check.sh`` when one is.
"""

from __future__ import annotations

import time
from typing import Callable

import torch


def parse(text: str | torch.device) -> torch.device:
    """``cpu``, ``cuda`` (this process's current GPU) or ``cuda:N``; an error naming the
    device where CUDA is missing."""
    device = torch.device(text)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {text}: CUDA is not available on this machine")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise SystemExit(f"--device {text}: the benchmarks run on cpu or cuda")
    return device


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of ``fn`` including the device work it queued (synchronised timer)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def describe(device: torch.device) -> str:
    """Host, device and torch version, for a calibration's ``measured_at``."""
    import platform

    what = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    return f"{platform.node()} {time.strftime('%Y-%m-%d')} {what} torch {torch.__version__}"
