"""The run's summary: ``summary.json`` and the lines the log ends with.

Every rank's figures (peak memory, bytes read, data waiting, step times) are gathered
(``gather_per_rank``: one small all-gather), so rank 0 writes them all.
"""

from __future__ import annotations

from typing import Any

import torch

from parallel import comm
from parallel.grid import Grid
from parallel.runtime.memory import peak_memory_bytes, peak_reserved_bytes
from parallel.train.observe.steptime import format_line as step_time_line

PER_RANK = ("peak_memory_bytes", "bytes_read", "data_wait_seconds", "samples_read", "peak_reserved_bytes")
"""The per-rank figures of a log step and the summary, in the order ``per_rank`` gathers them."""


def gather_per_rank(values: list[float], grid: Grid) -> torch.Tensor:
    """(world, len(values)) float64 of every rank's numbers, on every rank."""
    mine = torch.tensor(values, dtype=torch.float64, device=grid.device)
    if grid.world_size == 1:
        return mine[None].cpu()
    return torch.stack(comm.all_gather(mine, grid.world_group, caller="report.gather_per_rank")).cpu()


def per_rank(io: Any, io_start: tuple[float, float, float], grid: Grid) -> torch.Tensor:
    """Every rank's ``PER_RANK`` figures (collective): its peaks so far, and its reading this
    session (``io``: the run's ``IOCounters``; ``io_start``: their values at the session's start)."""
    b0, w0, s0 = io_start
    return gather_per_rank([peak_memory_bytes(grid.device), io.bytes_read - b0, io.wait_seconds - w0,
                            io.samples - s0, peak_reserved_bytes(grid.device)], grid)


def data_mean(x: torch.Tensor, grid: Grid) -> float:
    """The mean over data groups of a value replicated within each spatial group (collective)."""
    x = x.detach().clone().double()
    if grid.data_size > 1:
        comm.all_reduce_(x, grid.data_group, "avg", caller="summary.data_mean")
    return float(x)


def summarize(grid: Grid, values: dict[str, Any], figures: torch.Tensor, samples_trained: int) -> dict[str, Any]:
    """The final summary: ``values`` with every rank's ``figures`` (``per_rank``): per-rank
    memory and bytes per sample, the grid and the samples trained."""
    out = dict(values)
    out["peak_memory_bytes_per_rank"] = [int(v) for v in figures[:, 0].tolist()]
    if figures.shape[1] > 4:
        out["peak_reserved_bytes_per_rank"] = [int(v) for v in figures[:, 4].tolist()]
    read = figures[:, 1]
    samples = figures[:, 3].clamp(min=1)
    out["bytes_read_per_rank"] = [int(v) for v in read.tolist()]
    out["bytes_read_per_rank_per_sample"] = [float(v) for v in (read / samples).tolist()]
    out["data_wait_seconds_per_rank"] = [round(float(v), 3) for v in figures[:, 2].tolist()]
    out["grid"] = {"world": grid.world_size, "data": grid.data_size, "spatial": list(grid.spatial)}
    out["samples_trained"] = samples_trained
    return out


def conv_paths(model: Any) -> dict[str, int]:
    """How many split convolutions took each path at their last forward (``parallel.conv_path``:
    ``shell`` or ``window``; ``auto`` resolves to one of them per layer)."""
    out: dict[str, int] = {}
    for m in model.modules():
        path = getattr(m, "path_chosen", None)
        if path is not None:
            out[path] = out.get(path, 0) + 1
    return out


def format_summary(s: dict[str, Any]) -> str:
    """A few human lines of the summary."""
    mib = [f"{v / 2**20:.0f}" for v in s["peak_memory_bytes_per_rank"]]
    per_sample = [f"{v / 2**10:.1f}" for v in s["bytes_read_per_rank_per_sample"]]
    ttt = s.get("time_to_target_s")
    why = {"success": "reached the target", "max_steps": "stopped at train.max_steps",
           "completed": "completed train.epochs without reaching the target"}.get(s["status"], s["status"])
    sess = s.get("session") or {}
    resumed = f", resumed at step {sess['first_step']}" if sess.get("first_step") else ""
    lines = [
        f"status: {s['status']} ({why}) after {s['steps']} steps, {s['epochs']:.2f} epochs "
        f"(grid data {s['grid']['data']} x spatial {s['grid']['spatial']}){resumed}",
        f"{s['metric']}: {s.get('best_metric')} (target {s['target']})"
        + (f", time to target {ttt:.1f} s" if ttt is not None else ", target not reached"),
        f"this session: {sess.get('steps', s['steps'])} steps, {sess.get('samples', 0)} samples; train throughput "
        f"{s['samples_per_s']:.2f} samples/s, run time {s['run_seconds']:.1f} s",
        f"peak memory per rank (MiB): {', '.join(mib)} allocated"
        + (f"; {', '.join(f'{v / 2**20:.0f}' for v in s['peak_reserved_bytes_per_rank'])} reserved"
           if s.get("peak_reserved_bytes_per_rank") else ""),
        f"bytes read per rank per sample (KiB): {', '.join(per_sample)}",
    ]
    breakdown = step_time_line(s)
    if breakdown:
        lines.append(breakdown)
    if s.get("run_dir"):
        lines.append(f"run.dir: {s['run_dir']}")
    return "\n".join(lines)
