"""``parallel.spatial=auto``: the split ``parallel.plan`` predicts fastest among those that
fit, for a training job's model, sample volume, global batch and world size."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from parallel import plan
from parallel.train.checks import SampleFacts

log = logging.getLogger("parallel")


def world_size_from_env(env: dict[str, str] | None = None) -> int:
    """The job's world size as the launcher announces it (before torch.distributed starts)."""
    env = dict(os.environ) if env is None else env
    for key in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS"):
        if env.get(key, "").isdigit():
            return int(env[key])
    return 1


def _memory_per_rank(cfg: Any, local_size: int) -> float:
    if cfg.parallel.device_memory_gb > 0:
        return cfg.parallel.device_memory_gb * 1e9
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(local_size, 1)


def auto_spatial(cfg: Any, family: Any, facts: SampleFacts, world_size: int | None = None,
                 local_size: int = 1) -> list[int]:
    """``parallel.spatial=auto``: the spatial split of the fastest (data x spatial) split that
    fits, for this job's model, sample volume (``facts``), global batch and world size.

    The training loop calls it on rank 0 only and broadcasts the answer
    (``parallel.init``), so every rank builds the same grid whatever its own files say.
    The calibration is ``$SPATIALCNN_CALIBRATION`` or ``runs/calibration.json``; without
    one the model's built-in figures are used, and a warning says so.
    """
    world = world_size if world_size is not None else world_size_from_env()
    with torch.device("meta"):
        model = family.build_model(cfg.model, facts.volume)
    layers = plan.trace(model, (facts.channels, *facts.volume))
    opts = plan.Options(global_batch=max(1, cfg.train.global_batch_size // cfg.train.accum_steps),
                        stored_bytes_per_voxel=facts.stored_bytes_per_voxel, overlap=cfg.parallel.overlap_halo,
                        recompute=cfg.train.activation_checkpointing,
                        optimizer_states=2 if str(cfg.optim.name) == "adamw" else 1,
                        node_ranks=1 if torch.cuda.is_available() else local_size,
                        shard_linear=str(cfg.optim.name) != "kfac")
    if str(cfg.optim.name) == "kfac":  # its factor work, all-reduces and memory count too
        from parallel.plan.kfac import KFACPlan

        opts.kfac = KFACPlan(model, (facts.channels, *facts.volume), cfg.optim.kfac)
    calibration = plan.default_calibration()
    machine = plan.Machine.load()
    if machine.generic:
        log.warning("parallel.spatial=auto: no calibration at %s; planning with %s (or point "
                    "SPATIALCNN_CALIBRATION at one)", calibration, machine.label)
    spatial = plan.choose(layers, machine, world, _memory_per_rank(cfg, local_size), opts)
    return list(spatial)
