"""This process's memory, read one way for everything that reports it: the training
summary (``parallel.train``), the memory budget (``parallel.memory_limit``), the planner's
runtime baseline and the benchmarks (``parallel.bench``); and sizes such as ``3GiB`` in
bytes (``parallel.memory_limit``, ``python -m parallel.plan --device-memory``).

CPU: the resident set (Linux ``/proc/self``: ``VmRSS`` now, ``VmHWM`` its peak, reset by
``5`` into ``/proc/self/clear_refs``). CUDA: the caching allocator's statistics; what
the device holds for the process is its *reserved* bytes plus the *context* (the CUDA
context, cuBLAS/cuDNN workspaces and NCCL's buffers, which live outside the allocator
and which ``max_memory_allocated`` leaves out: ``mem_get_info``'s used bytes minus
reserved).
"""

from __future__ import annotations

import os
import resource

import torch


def peak_rss_bytes() -> int:
    """Peak resident set size of this process: Linux's VmHWM (reset by ``reset_peak``);
    elsewhere ``ru_maxrss``, which would report the launcher's peak where that is larger,
    as it is inherited across exec."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux and BSD report KiB


def resident_bytes() -> int:
    """This process's resident memory now (Linux ``VmRSS``), else its peak."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def reset_peak(device: torch.device) -> bool:
    """Start the peaks afresh (CUDA: the allocator's peak statistics; CPU: VmHWM back to
    the resident size). False where the system does not allow it (the peak then includes
    what came before)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory_bytes(device: torch.device) -> int:
    """Peak of the live tensors (CUDA ``max_memory_allocated``) or of the resident set (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


def peak_reserved_bytes(device: torch.device) -> int:
    """Peak memory the process held, beside the live tensors' peak: CUDA's caching
    allocator reserves more than it hands out (fragmentation, cached blocks), and that is
    what an out-of-memory error counts; on the CPU the resident peak (as above)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    return peak_rss_bytes()


def context_bytes(device: torch.device) -> float:
    """Device memory this process holds outside the caching allocator (CUDA context,
    library workspaces, NCCL buffers; on a GPU shared with other processes, theirs too)."""
    if device.type != "cuda":
        return 0.0
    free, total = torch.cuda.mem_get_info(device)
    return max(0.0, float(total - free) - float(torch.cuda.memory_reserved(device)))


def in_use_bytes(device: torch.device) -> float:
    """Memory held now: resident (CPU), or reserved plus context (CUDA)."""
    if device.type == "cuda":
        return float(torch.cuda.memory_reserved(device)) + context_bytes(device)
    return float(resident_bytes())


def peak_held_bytes(device: torch.device) -> float:
    """Peak memory held since ``reset_peak``: VmHWM (CPU), or the peak reserved bytes plus
    the context (CUDA: what the device had to hold, not only the live tensors)."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_reserved(device)) + context_bytes(device)
    return float(peak_rss_bytes())


def parse_bytes(text: str) -> float:
    """``80GB``, ``512MiB``, ``1e9`` -> bytes."""
    t = text.strip().upper()
    for suffix, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("TB", 1e12), ("GB", 1e9),
                         ("MB", 1e6), ("KB", 1e3), ("B", 1)):
        if t.endswith(suffix):
            return float(t[: -len(suffix)]) * mult
    return float(t)
