"""``parallel.spatial=auto``: the split ``parallel.plan`` predicts fastest among those that
fit, for a training job's model, sample volume, global batch and world size; and the
job's plan and memory budget that ``parallel.train.checks.budget`` checks a fixed grid against."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from parallel import plan
from parallel.job.config import JobConfig, ParallelConfig
from parallel.runtime.memory import parse_bytes, resident_bytes
from parallel.train.checks.config import train_volume
from parallel.train.checks.samples import SampleFacts

log = logging.getLogger("parallel")

FIRST_STEP_BYTES = 5.0e7
"""Resident bytes a CPU rank gains in its first step besides the model's tensors, on top
of what it holds before the model is built: the optimiser's first call imports torch's
compiler stack (~70 MB of modules), oneDNN and gloo set up their buffers, the sample
reader its HDF5 caches: 21 MB measured with a 16^3 CosmoFlow, whose tensors are
nothing, rounded up (``docs/performance.md``, "A memory budget per rank")."""


def world_size_from_env(env: dict[str, str] | None = None) -> int:
    """The job's world size as the launcher announces it (before torch.distributed starts)."""
    env = dict(os.environ) if env is None else env
    for key in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS"):
        if env.get(key, "").isdigit():
            return int(env[key])
    return 1


def memory_limit_bytes(value: Any) -> float | None:
    """``parallel.memory_limit`` (``value``) in bytes (None when unset); a value that is
    neither a number of bytes nor a size such as ``3GiB`` is a ``ValueError`` naming the key."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    try:
        limit = float(value) if isinstance(value, (int, float)) else parse_bytes(str(value))
    except ValueError:
        raise ValueError(f"parallel.memory_limit={value!r}: not a size; give bytes or e.g. 3GiB, 500MB") from None
    if not limit > 0:
        raise ValueError(f"parallel.memory_limit={value!r}: must be above 0 (or unset for no budget)")
    return limit


def _memory_per_rank(par: ParallelConfig, local_size: int) -> float:
    """What ``auto`` plans for (``par``: the parallel section): the budget, else
    ``device_memory_gb``, else the GPU's memory, else the host's memory over the ranks
    sharing it."""
    limit = memory_limit_bytes(par.memory_limit)
    if limit is not None:
        return limit
    if par.device_memory_gb > 0:
        return par.device_memory_gb * 1e9
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(local_size, 1)


def job_plan(cfg: JobConfig, family: Any, facts: SampleFacts,
             local_size: int = 1) -> tuple[list[plan.Layer], plan.Machine, plan.Options]:
    """The traced layers, the machine and the step options of this training job.

    On CPUs the machine's runtime baseline is this process's resident memory now plus what
    its first step adds (``FIRST_STEP_BYTES``): the imports, the process group and the
    config are already here and measured, not guessed; on GPUs it stays the machine's."""
    volume = train_volume(cfg.data.crop, facts.volume)
    with torch.device("meta"):
        model = family.build_model(cfg.model, volume)
    layers = plan.trace(model, (facts.channels, *volume))
    opts = plan.Options(global_batch=max(1, cfg.train.global_batch_size // cfg.train.accum_steps),
                        stored_bytes_per_voxel=facts.stored_bytes_per_voxel, overlap=cfg.parallel.overlap_halo,
                        recompute=cfg.train.activation_checkpointing,
                        optimizer_states=2 if str(cfg.optim.name) == "adamw" else 1,
                        node_ranks=1 if torch.cuda.is_available() else local_size,
                        shard_linear=str(cfg.optim.name) != "kfac")
    if str(cfg.optim.name) == "kfac":  # its factor work, all-reduces and memory count too
        from parallel.plan.kfac import KFACPlan

        opts.kfac = KFACPlan(model, (facts.channels, *volume), cfg.optim.kfac)
    machine = plan.Machine.load()
    if not torch.cuda.is_available() and resident_bytes() > 0:
        machine.baseline_memory = resident_bytes() + FIRST_STEP_BYTES
    return layers, machine, opts


def auto_spatial(cfg: JobConfig, family: Any, facts: SampleFacts, world_size: int | None = None,
                 local_size: int = 1) -> list[int]:
    """``parallel.spatial=auto``: the spatial split of the fastest (data x spatial) split that
    fits, for this job's model, sample volume (``facts``), global batch and world size.

    The training loop calls it on rank 0 only and broadcasts the answer
    (``parallel.init``), so every rank builds the same grid whatever its own files say.
    The calibration is ``$SPATIALCNN_CALIBRATION`` or ``runs/calibration.json``; without
    one the model's built-in figures are used, and a warning says so. With
    ``parallel.memory_limit`` set, no split that fits it is a ``ValueError`` with the
    numbers (the job ends with exit 2).
    """
    world = world_size if world_size is not None else world_size_from_env()
    layers, machine, opts = job_plan(cfg, family, facts, local_size)
    if machine.generic:
        log.warning("parallel.spatial=auto: no calibration at %s; planning with %s (or point "
                    "SPATIALCNN_CALIBRATION at one)", plan.default_calibration(), machine.label)
    limit = _memory_per_rank(cfg.parallel, local_size)
    if memory_limit_bytes(cfg.parallel.memory_limit) is not None:
        rows = plan.table(layers, machine, world, limit, opts)
        if rows and not any(r["fits"] for r in rows):
            low = min(rows, key=lambda r: r["memory_bytes"])
            raise ValueError(
                f"no split of {world} ranks fits parallel.memory_limit={limit / 2**20:.0f} MiB per rank: the "
                f"smallest predicted peak is {low['memory_bytes'] / 2**20:.0f} MiB (data {low['data']} x spatial "
                f"{'x'.join(map(str, low['spatial']))}); {plan.fit_hint(layers, machine, limit, opts, low['data'])}")
    spatial = plan.choose(layers, machine, world, limit, opts)
    return list(spatial)
