"""Which layers K-FAC preconditions, and how each one's gradient is laid out as a matrix.

A layer's weight gradient (and bias) is viewed as one matrix of shape (dim G, dim A):

- Conv3d and Linear: ``[weight.view(out, -1) | bias]``: A over input patches (+1 for the
  bias), G over output channels.
- ConvTranspose3d (the adjoint view, ``parallel.kfac.patches``): ``weight.view(in, -1)^T``:
  A over input channels, G over output channels x kernel offsets. Its bias takes the plain
  update (it sums over output positions, which do not pair with input positions).

Layers are named by the module's name in the serial model (``ParallelModule`` unwrapped);
the state is keyed by the weight's parameter name (``<module>.weight``).
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch
from torch import nn

from parallel.kfac.config import KFACConfig
from parallel.kfac.local import Own, own as own_blocks, refines, sharding_policy
from parallel.layers.linear import SpatialLinear

Kind = Literal["conv", "convT", "linear", "flat"]


@dataclass(eq=False)
class Layer:
    """One preconditioned layer and what the current step has captured for it."""

    name: str
    module: nn.Module
    kind: Kind
    dim_a: int
    dim_g: int
    # The step's statistics (``parallel.kfac.capture``): Gram sums for convolutions, raw
    # rows for linear layers (their features and gradients are reduced over space first).
    a_sum: torch.Tensor | None = None
    a_count: float = 0.0
    g_sum: torch.Tensor | None = None
    rows: int = 0
    lin_a: list[torch.Tensor] = field(default_factory=list)
    lin_g: list[torch.Tensor] = field(default_factory=list)
    pending: Any = None
    # A factor wider than kfac.max_factor_dim, held low rank plus diagonal
    # (``parallel.kfac.lowrank``): which one ("A" or "G"), its rank and its test matrix
    # (set by the optimiser); its step sums and running value are sketches (dim, m + 1).
    wide: str | None = None
    rank: int = 0
    omega: torch.Tensor | None = None
    # A Flatten+Linear's A in the hierarchical form (``kfac.flat_blocks``): the split, and
    # once a forward has shown the flattened (C, D, H, W), each diagonal block's features
    split: tuple[int, int, int] | None = None
    blocks: list[torch.Tensor] | None = None
    # ... and where its weight is sharded by block, the blocks this rank holds (``parallel.kfac.local``)
    own: Own | None = None

    def see_volume(self, shape: tuple[int, ...]) -> None:
        """The flattened input's (C, D, H, W): fixes the diagonal blocks of a hierarchical A."""
        if self.split is None or self.blocks is not None:
            return
        c, *dims = shape
        pos = torch.arange(c * dims[0] * dims[1] * dims[2]).view(c, *dims)
        blocks = []
        for bd in torch.tensor_split(torch.arange(dims[0]), self.split[0]):
            for bh in torch.tensor_split(torch.arange(dims[1]), self.split[1]):
                for bw in torch.tensor_split(torch.arange(dims[2]), self.split[2]):
                    if len(bd) and len(bh) and len(bw):
                        blocks.append(pos[:, bd][:, :, bh][:, :, :, bw].reshape(-1).sort().values)
        if self.dim_a > pos.numel():  # the bias feature: a block of its own
            blocks.append(torch.arange(pos.numel(), self.dim_a))
        self.blocks = [b.to(self.weight.device) for b in blocks]
        shard = getattr(self.module, "shard", None)
        if shard is not None:  # the rank's features: its block of the volume, ascending (the shard's columns)
            (d0, d1), (h0, h1), (w0, w1) = shard.ranges
            cols = pos[:, d0:d1, h0:h1, w0:w1].reshape(-1).to(self.weight.device)
            self.own = own_blocks(self.blocks, cols, self.dim_a > pos.numel())

    @property
    def leaves(self) -> list[torch.Tensor]:
        """The diagonal blocks of a hierarchical A this rank holds: all, or its own."""
        blocks = self.blocks or []
        return blocks if self.own is None else [blocks[j] for j in self.own.blocks]

    def dim(self, side: str) -> int:
        return self.dim_a if side == "A" else self.dim_g

    def shape(self, side: str) -> tuple[int, int]:
        """The shape of side ``side``'s factor as kept: dense (d, d) or a sketch (d, m + 1)."""
        d = self.dim(side)
        if side == self.wide and self.blocks is not None and side == "A":  # sketch, then the blocks' triangles
            held = self.blocks if self.own is None else [self.blocks[i] for i in self.own.blocks]
            return (d * (self.omega.shape[1] + 1) + sum(len(b) * (len(b) + 1) // 2 for b in held),)  # type: ignore[union-attr]
        return (d, self.omega.shape[1] + 1) if side == self.wide and self.omega is not None else (d, d)

    @property
    def key(self) -> str:
        return f"{self.name}.weight" if self.name else "weight"

    @property
    def weight(self) -> nn.Parameter:
        return self.module.weight  # type: ignore[return-value]

    @property
    def bias(self) -> nn.Parameter | None:
        return None if self.kind == "convT" else self.module.bias  # type: ignore[return-value]

    @property
    def replicated(self) -> bool:
        """Statistics computed identically on every rank of a spatial group (linear layers,
        once their features and gradients are summed over space)."""
        return self.kind in ("linear", "flat")

    def clear(self) -> None:
        self.a_sum, self.a_count, self.g_sum, self.rows = None, 0.0, None, 0
        self.lin_a, self.lin_g, self.pending = [], [], None

    def grad_matrix(self) -> torch.Tensor | None:
        """The gradient as a (dim G, dim A) matrix, or None when it is missing."""
        w, b = self.weight.grad, None if self.bias is None else self.bias.grad
        if w is None or (self.bias is not None and b is None):
            return None
        if self.kind == "convT":
            return w.reshape(w.shape[0], -1).t()
        m = w.reshape(w.shape[0], -1)
        return m if b is None else torch.cat([m, b.reshape(-1, 1)], dim=1)

    def set_grad(self, m: torch.Tensor) -> None:
        """Write a (dim G, dim A) matrix back into the gradients, in place."""
        w, b = self.weight.grad, None if self.bias is None else self.bias.grad
        assert w is not None
        if self.kind == "convT":
            w.copy_(m.t().reshape(w.shape))
            return
        n = w[0].numel()
        w.copy_(m[:, :n].reshape(w.shape))
        if b is not None:
            b.copy_(m[:, n])


def serial_type(module: nn.Module) -> str:
    """The torch.nn class a (possibly spatial) layer stands for: ``Conv3d`` for SpatialConv3d."""
    return next(c.__name__ for c in type(module).__mro__ if c.__module__.startswith("torch.nn"))


def _dims(module: nn.Module, cfg: KFACConfig) -> tuple[Kind, int, int] | str:
    """(kind, dim A, dim G), or why the layer is not preconditioned."""
    if isinstance(module, SpatialLinear) and module.shard is not None:
        dim_a = module.in_features + (module.bias is not None)
        spatial = module.grid.spatial  # type: ignore[attr-defined]
        if _local(dim_a, module.out_features, cfg) and refines(cfg.flat_blocks, spatial, module.shard.dims):
            return "flat", dim_a, module.out_features
        return (f"its weight is sharded by block (parallelize's input_shape): K-FAC preconditions a sharded "
                f"weight only with its A (here {dim_a} wide) above kfac.max_factor_dim {cfg.max_factor_dim} "
                f"held hierarchically with kfac.flat_blocks matching or refining the split (got "
                f"{list(cfg.flat_blocks)}, parallel.spatial {list(spatial)}, volume {list(module.shard.dims)})")
    if isinstance(module, SpatialLinear):
        if tuple(module.weight.shape) != (module.out_features, module.in_features):
            # a rank holding only its columns: the factors and update need the whole weight
            return (f"its weight is sharded over the spatial group ({tuple(module.weight.shape)} of "
                    f"({module.out_features}, {module.in_features})); K-FAC needs the whole weight")
        return "flat", module.in_features + (module.bias is not None), module.out_features
    if isinstance(module, nn.Linear):
        return "linear", module.in_features + (module.bias is not None), module.out_features
    if isinstance(module, (nn.Conv3d, nn.ConvTranspose3d)):
        if module.groups != 1:
            return f"groups={module.groups} (grouped convolutions are not factored)"
        k = math.prod(module.kernel_size)
        if isinstance(module, nn.ConvTranspose3d):
            return "convT", module.in_channels, module.out_channels * k
        return "conv", module.in_channels * k + (module.bias is not None), module.out_channels
    return "not a Conv3d, ConvTranspose3d or Linear"


def _local(dim_a: int, dim_g: int, cfg: KFACConfig) -> bool:
    """Whether a Flatten+Linear of these widths holds its A hierarchically (so it can hold it
    local to the blocks of a sharded weight)."""
    return bool(cfg.flat_blocks) and str(cfg.wide_factors) == "lowrank" and dim_a > cfg.max_factor_dim >= dim_g


def _chosen(name: str, module: nn.Module, cfg: KFACConfig) -> str | None:
    """Why ``include``, ``exclude`` or a frozen weight leave the layer out, or None."""
    kind = serial_type(module)
    if cfg.include and not any(fnmatch.fnmatchcase(name, p) for p in cfg.include):
        return f"{kind}: not matched by kfac.include {list(cfg.include)}"
    hit = next((p for p in cfg.exclude if fnmatch.fnmatchcase(name, p)), None)
    if hit is not None:
        return f"{kind}: matched by kfac.exclude '{hit}'"
    if not module.weight.requires_grad:  # type: ignore[union-attr]
        return f"{kind}: frozen weight"
    return None


def holds_locally(cfg: KFACConfig) -> Callable[[str, nn.Module], bool]:
    """``selected(name, module)`` of ``local.shard_policy``: K-FAC preconditions the (whole)
    Flatten+Linear ``module`` with its A in the hierarchical form."""
    def selected(name: str, module: nn.Module) -> bool:
        return isinstance(module, SpatialLinear) and _chosen(name, module, cfg) is None and \
            _local(module.in_features + (module.bias is not None), module.out_features, cfg)
    return selected


def shard_policy(cfg: KFACConfig) -> Callable[[str, nn.Module, tuple[int, ...]], bool]:
    """``parallelize``'s ``shard_linear`` under K-FAC: a Flatten+Linear's weight is sharded
    by block where K-FAC holds its A in the hierarchical form and ``flat_blocks`` matches or
    refines the grid's split of the flattened volume (its diagonal blocks then stay on their
    ranks, ``parallel.kfac.local``); every other one stays whole."""
    return sharding_policy(holds_locally(cfg), list(cfg.flat_blocks))


def find_layers(model: nn.Module, cfg: KFACConfig) -> tuple[list[Layer], list[tuple[str, str]]]:
    """The layers to precondition (model order) and the skipped ones with the reason."""
    layers: list[Layer] = []
    skipped: list[tuple[str, str]] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Conv3d, nn.ConvTranspose3d)):
            continue
        kind = serial_type(module)
        why = _chosen(name, module, cfg)
        if why is not None:
            skipped.append((name, why))
            continue
        dims = _dims(module, cfg)
        if isinstance(dims, str):
            skipped.append((name, f"{kind}: {dims}"))
            continue
        wide = max(dims[1], dims[2])
        structured = None
        if wide > cfg.max_factor_dim:
            which = "A" if dims[1] >= dims[2] else "G"
            both = min(dims[1], dims[2]) > cfg.max_factor_dim
            if str(cfg.wide_factors) != "lowrank" or both:
                why = "both factors are" if both else f"factor {which} is {wide}"
                skipped.append((name, f"{kind}: {why} wide > kfac.max_factor_dim {cfg.max_factor_dim}"
                                      + ("" if both else " (kfac.wide_factors=plain)")))
                continue
            structured = which
        split = (tuple(cfg.flat_blocks) if cfg.flat_blocks and structured == "A" and dims[0] in ("flat", "linear")
                 else None)
        layers.append(Layer(name, module, *dims, wide=structured, rank=min(cfg.rank, wide) if structured else 0,
                            split=split))  # type: ignore[arg-type]
    return layers, skipped
