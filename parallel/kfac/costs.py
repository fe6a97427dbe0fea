"""What K-FAC costs per step and per rank, counted before a run (for ``parallel.plan``).

``kfac_costs(model, input_shape, cfg, spatial, world_size)`` traces the serial model on
the meta device (a copy; the model is untouched) and counts, with the same layer choice
and buffer layout as the optimiser:

- ``factor_allreduce_bytes``: payload of the world all-reduce of one factor update
  (upper triangles of every A and G, plus a count per layer); ``linear_allreduce_bytes``:
  payload of the spatial all-reduce of the linear layers' rows (0 when spatial is 1);
- ``factor_flops``: Gram products on this rank per factor update (its block's patches; a
  convolution's A over the positions ``position_stride`` samples);
  ``patch_bytes``: the patches (and linear rows) those products copy out of the activations;
- ``inverse_flops``: eigendecomposition flops (~9 d^3 each; a low-rank factor's Nystrom
  step ~6 d m^2) of the busiest rank under the optimiser's assignment, plus the low-rank
  factors' Woodbury cores (2 n d r^2, formed on every rank), and ``inverse_flops_total``
  over all ranks; ``broadcast_bytes``:
  the eigenvectors and eigenvalues broadcast per inverse update;
- ``precondition_flops``: the four matrix products per layer, every step, on every rank;
- ``memory_bytes``: per rank, factors + eigendecompositions + the step's Gram sums + the
  all-reduce buffer + one chunk of patches (``KFACConfig.chunk_mb``).

``per_step()`` spreads the interval work over the steps between updates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from parallel.kfac.config import KFACConfig
from parallel.kfac.factors import packed_size
from parallel.kfac.inverse import EIGH_FLOPS_PER_DIM3, assign, loads
from parallel.kfac import lowrank
from parallel.kfac.layers import find_layers
from parallel.kfac.lowrank import NYSTROM_FLOPS_PER_DM2, sketch_width
from parallel.kfac.subsample import sampled_positions
from parallel.model.trace import hooked, meta_copy, meta_forward, on_meta


@dataclass
class KFACCosts:
    """Counts for one rank of a (data x spatial) grid; bytes and flops per update or step."""

    factor_interval: int
    inverse_interval: int
    layers: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    factor_allreduce_bytes: float = 0.0
    linear_allreduce_bytes: float = 0.0
    factor_flops: float = 0.0
    patch_bytes: float = 0.0
    inverse_flops: float = 0.0
    inverse_flops_total: float = 0.0
    broadcast_bytes: float = 0.0
    precondition_flops: float = 0.0
    memory_bytes: float = 0.0

    def per_step(self) -> dict[str, float]:
        """Average per optimiser step: interval work divided by its interval."""
        fi, ii = self.factor_interval, self.inverse_interval
        return {"allreduce_bytes": (self.factor_allreduce_bytes + self.linear_allreduce_bytes) / fi,
                "factor_flops": self.factor_flops / fi, "patch_bytes": self.patch_bytes / fi,
                "inverse_flops": self.inverse_flops / ii,
                "broadcast_bytes": self.broadcast_bytes / ii, "precondition_flops": self.precondition_flops}


def _shapes(model: nn.Module, per_sample: Sequence[int]) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per-sample (input, output) shapes of every Conv3d, ConvTranspose3d and Linear (a
    forward on the meta device, ``parallel.model.trace``; the model untouched)."""
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def record(name: str, _m: nn.Module, inputs: tuple, output: Any) -> None:
        shapes.setdefault(name, (tuple(inputs[0].shape[1:]), tuple(output.shape[1:])))

    dry = model if on_meta(model) else meta_copy(model)
    with hooked(dry, record, lambda _n, m: isinstance(m, (nn.Conv3d, nn.ConvTranspose3d, nn.Linear))):
        meta_forward(dry, per_sample)
    return shapes


def _flattened(model: nn.Module) -> set[str]:
    """Names of the Linear layers that ``parallelize`` turns into ``SpatialLinear`` (directly
    after a Flatten in an nn.Sequential): their features are summed over space."""
    names: set[str] = set()
    for prefix, m in model.named_modules():
        if isinstance(m, nn.Sequential):
            kids = list(m.named_children())
            for (_, a), (name, b) in zip(kids, kids[1:]):
                if isinstance(a, nn.Flatten) and isinstance(b, nn.Linear):
                    names.add(f"{prefix}.{name}" if prefix else name)
    return names


def kfac_costs(model: nn.Module, input_shape: Sequence[int], cfg: KFACConfig | None = None,
               spatial: Sequence[int] = (1, 1, 1), world_size: int | None = None) -> KFACCosts:
    """K-FAC's communication, work and memory per rank for ``model`` (serial) on a global
    batch of ``input_shape`` (N, C, D, H, W) over ``world_size`` ranks (default: the
    spatial size, one data group) split ``spatial``."""
    cfg = cfg if cfg is not None else KFACConfig()
    cfg.validate()
    s = math.prod(spatial)
    world = world_size if world_size is not None else s
    if world % s:
        raise ValueError(f"world size {world} is not a multiple of the spatial size {s} ({list(spatial)})")
    data = world // s
    batch = input_shape[0] / data
    weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    fdt, idt = cfg.dtypes(weights)
    fbytes = torch.finfo(fdt).bits // 8
    ibytes = torch.finfo(idt).bits // 8
    layers, skipped = find_layers(model, cfg)
    shapes = _shapes(model, input_shape[1:])
    flattened = _flattened(model)
    out = KFACCosts(cfg.factor_interval, cfg.inverse_interval, skipped=skipped)
    items: list[float] = []  # inverse work (flops) of each factor, spread over the ranks
    replicated = 0.0  # the low-rank factors' Woodbury cores, formed on every rank
    memory = 0.0
    for layer in layers:
        da, dg = layer.dim_a, layer.dim_g
        in_shape, out_shape = shapes.get(layer.name, ((), ()))
        # per captured vector: a dense factor's Gram product 2 d^2; a sketched one 4 d m
        # (a^T Omega, then a times it) and its diagonal
        m = sketch_width(layer.dim(layer.wide), cfg.rank, cfg.oversample) if layer.wide else 0
        gram = {side: (4.0 * layer.dim(side) * m if side == layer.wide else 2.0 * layer.dim(side) ** 2)
                for side in "AG"}
        flops = 0.0
        if layer.kind == "conv":  # A over output patches, G over output positions: 1/S of them here
            positions = batch * math.prod(out_shape[1:]) / s
            # A over the positions kfac.position_stride samples, in kfac.gram_dtype
            sampled = batch * sampled_positions(out_shape[1:], cfg.position_stride) / s
            flops = sampled * gram["A"] + positions * gram["G"]
            out.patch_bytes += torch.finfo(cfg.product_dtype(fdt)).bits // 8 * sampled * da
        elif layer.kind == "convT":  # both over input positions (adjoint view)
            positions = batch * math.prod(in_shape[1:]) / s
            flops = positions * (gram["A"] + gram["G"])
            out.patch_bytes += fbytes * positions * dg
        else:  # every rank forms the whole (replicated) Gram matrices of the batch rows
            flops = batch * (gram["A"] + gram["G"])
            out.patch_bytes += fbytes * batch * (da + dg)
            if s > 1:  # output gradients, and the features of a Flatten+Linear
                features = da - (layer.bias is not None) if layer.name in flattened else 0
                out.linear_allreduce_bytes += fbytes * batch * (dg + features)
        out.factor_flops += flops
        if layer.wide is None:
            out.factor_allreduce_bytes += fbytes * (packed_size(da) + 1 + packed_size(dg))
            out.broadcast_bytes += ibytes * (da * da + da + dg * dg + dg)
            out.precondition_flops += 4.0 * (dg * dg * da + dg * da * da)
            memory += fbytes * 2 * (da * da + dg * dg) + ibytes * (da * da + da + dg * dg + dg)
            memory += fbytes * (packed_size(da) + 1 + packed_size(dg))
            items += [EIGH_FLOPS_PER_DIM3 * float(da) ** 3, EIGH_FLOPS_PER_DIM3 * float(dg) ** 3]
        else:  # the wide factor d as a sketch, rank r; the other (n wide) dense
            d, n, r = layer.dim(layer.wide), layer.dim("G" if layer.wide == "A" else "A"), layer.rank
            out.factor_allreduce_bytes += fbytes * (d * (m + 1) + 1 + packed_size(n))
            out.broadcast_bytes += ibytes * (d * r + r + d + n * n + n)
            out.precondition_flops += 4.0 * n * n * d + 4.0 * n * d * r
            memory += fbytes * lowrank.memory_elements(d, n, cfg.rank, cfg.oversample)
            memory += fbytes * 3 * n * n + ibytes * (n * n + n) + fbytes * packed_size(n)
            items += [NYSTROM_FLOPS_PER_DM2 * d * m * m, EIGH_FLOPS_PER_DIM3 * float(n) ** 3]
            replicated += 2.0 * n * d * r * r
        out.layers.append({"name": layer.name, "kind": layer.kind, "dim_a": da, "dim_g": dg,
                           "factor_flops": flops, "low_rank": layer.wide, "rank": layer.rank})
    per_rank = loads(items, assign(items, world), world) if items else [0.0]
    out.inverse_flops = max(per_rank) + replicated
    out.inverse_flops_total = sum(items) + world * replicated
    out.memory_bytes = memory + (cfg.chunk_mb * 2**20 if layers else 0.0)
    return out
