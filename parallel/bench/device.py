"""The benchmarks' device: synchronised timers and memory as the device sees it.

CPU: wall-clock timers, resident memory (Linux ``/proc``). CUDA: kernels run
asynchronously, so every timed region starts and ends with ``torch.cuda.synchronize``;
memory is what the device holds for the process: the caching allocator's *reserved*
bytes (not only the allocated ones) plus the *context*: the CUDA context, cuBLAS/cuDNN
workspaces and NCCL's buffers, which live outside the allocator and which
``max_memory_allocated`` leaves out (``mem_get_info``'s used bytes minus reserved).
Nothing here has run on a GPU yet (none was available): the CUDA branches follow the
documented torch.cuda API and are exercised by ``scripts/gpu_check.sh`` when one is.
"""

from __future__ import annotations

import os
import resource
import time
from typing import Callable

import torch

from parallel.runtime.memory import peak_rss_bytes


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


def context_bytes(device: torch.device) -> float:
    """Device memory this process holds outside the caching allocator (CUDA context,
    library workspaces, NCCL buffers; on a GPU shared with other processes, theirs too)."""
    if device.type != "cuda":
        return 0.0
    free, total = torch.cuda.mem_get_info(device)
    return max(0.0, float(total - free) - float(torch.cuda.memory_reserved(device)))


def resident_bytes() -> float:
    """This process's resident memory now (Linux /proc), else its peak."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except OSError:
        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def in_use_bytes(device: torch.device) -> float:
    """Memory held now: resident (CPU), or reserved plus context (CUDA)."""
    if device.type == "cuda":
        return float(torch.cuda.memory_reserved(device)) + context_bytes(device)
    return resident_bytes()


def reset_peak(device: torch.device) -> bool:
    """Start the peak afresh (CPU: ``5`` into ``/proc/self/clear_refs``; CUDA: the
    allocator's peak statistics)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes(device: torch.device) -> float:
    """Peak memory since ``reset_peak``: VmHWM (CPU), or the peak reserved bytes plus the
    context (CUDA: what the device had to hold, not only the live tensors)."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_reserved(device)) + context_bytes(device)
    return float(peak_rss_bytes())


def describe(device: torch.device) -> str:
    """Host, device and torch version, for a calibration's ``measured_at``."""
    import platform

    what = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    return f"{platform.node()} {time.strftime('%Y-%m-%d')} {what} torch {torch.__version__}"
