"""K-FAC's share of a planned step: ``parallel.kfac.kfac_costs`` in seconds and bytes.

The counts (``docs/kfac.md#costs-before-a-run``) are per factor update, per inverse update
and per step; spread over their intervals they add to every step on average:

- the Gram products of a factor update and the preconditioning products run at the
  machine's dense throughput (``Machine.default_conv_flops``: both are matrix products),
  and the patches a factor update copies out (written, then read) at its memory bandwidth;
- the eigendecompositions of the busiest rank at the same throughput (``torch.linalg.eigh``
  reaches a similar share of it on CPUs, less on GPUs: a lower bound there);
- the factor all-reduce over the world (and the linear layers' rows over the spatial group)
  as ring all-reduces, the eigenvector broadcasts as one message per owning rank.

Memory per rank (factors, eigendecompositions, buffers) adds to the step's peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from torch import nn

from parallel.kfac import KFACConfig, kfac_costs
from parallel.plan.machine import Machine


def _allreduce_s(machine: Machine, ranks: int, nbytes: float) -> float:
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (ranks - 1) * machine.ar_alpha + 2 * (ranks - 1) / ranks * nbytes / machine.ar_beta


@dataclass
class KFACPlan:
    """What the planner needs to cost K-FAC: the serial model (meta device), one sample's
    input shape (C, D, H, W) and the settings."""

    model: nn.Module
    in_shape: Sequence[int]
    cfg: KFACConfig = field(default_factory=KFACConfig)

    def predict(self, machine: Machine, data: int, spatial: Sequence[int], global_batch: int) -> dict[str, Any]:
        """K-FAC's average seconds per step (``kfac_s`` and its parts) and memory per rank."""
        s = math.prod(spatial)
        world = data * s
        c = kfac_costs(self.model, (global_batch, *self.in_shape), self.cfg, spatial, world)
        per = c.per_step()
        rate = machine.default_conv_flops
        owners = min(world, 2 * len(c.layers))
        parts = {
            "kfac_factor_s": per["factor_flops"] / rate + 2 * per["patch_bytes"] / machine.mem_bandwidth,
            "kfac_inverse_s": per["inverse_flops"] / rate,
            "kfac_precondition_s": per["precondition_flops"] / rate,
            "kfac_allreduce_s": (_allreduce_s(machine, world, c.factor_allreduce_bytes)
                                 + _allreduce_s(machine, s, c.linear_allreduce_bytes)) / c.factor_interval,
            "kfac_broadcast_s": ((owners * machine.ar_alpha + c.broadcast_bytes / machine.ar_beta) / c.inverse_interval
                                 if world > 1 else 0.0),
        }
        return {"kfac_s": sum(parts.values()), **parts, "kfac_memory_bytes": c.memory_bytes,
                "kfac_layers": len(c.layers), "kfac_plain_layers": [name for name, _ in c.skipped],
                "kfac_low_rank_layers": [f"{x['name']} ({x['low_rank']} {max(x['dim_a'], x['dim_g'])} wide, rank "
                                         f"{x['rank']})" for x in c.layers if x["low_rank"]],
                "kfac_factor_allreduce_bytes": c.factor_allreduce_bytes, "kfac_factor_flops": c.factor_flops,
                "kfac_inverse_flops": c.inverse_flops}


def kfac_config(items: Sequence[str]) -> KFACConfig:
    """``KEY=VALUE`` settings (``damping=0.01 exclude=[head.*]``) as a validated ``KFACConfig``."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        merged = OmegaConf.merge(OmegaConf.structured(KFACConfig), OmegaConf.from_dotlist(list(items)))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ValueError(f"--kfac {' '.join(items)}: {err}".splitlines()[0]) from None
    assert isinstance(cfg, KFACConfig)
    cfg.validate()
    return cfg
