"""K-FAC's state per layer as every grid keeps it, and its check on loading.

One layer's entry holds its factors ``A``, ``G`` and their inverse forms: a dense
eigendecomposition ``Q``, ``l``; a low-rank plus diagonal factor ``U``, ``l``, ``d``; a
hierarchical one ``U``, ``l`` and every diagonal block's eigenvectors ``Q`` and
eigenvalues ``e``, concatenated in block order (its ``A`` is the sketch, then every
block's triangle). Where a rank holds only its own blocks (``parallel.kfac.local``) they
are gathered over the spatial group on saving and cut on loading, so a state saved at one
grid loads at any other, the replicated form included.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from parallel.kfac import local
from parallel.kfac.config import KFACConfig
from parallel.kfac.factors import packed_size
from parallel.kfac.layers import Layer
from parallel.kfac.local import LocalBlocked
from parallel.kfac.lowrank import Blocked, Structured, memory_elements

log = logging.getLogger("parallel.kfac")


def entry(layer: Layer, a: torch.Tensor, g: torch.Tensor, held: tuple[Any, Any] | None, grid: Any
          ) -> dict[str, torch.Tensor]:
    """The layer's entry (a collective over the spatial group where it holds its blocks locally)."""
    own = layer.own
    out = {"A": a if own is None else _gather_grams(layer, a, grid.spatial_group), "G": g}
    for side, form in zip("AG", held or ()):
        if isinstance(form, LocalBlocked):
            assert own is not None
            count = len(layer.blocks or [])
            out.update({f"U{side}": form.u, f"l{side}": form.lam,
                        f"Q{side}": torch.cat(local.gather(form.q, own.blocks, count, grid.spatial_group)),
                        f"e{side}": torch.cat(local.gather(form.e, own.blocks, count, grid.spatial_group))})
        elif isinstance(form, Blocked):
            out.update({f"U{side}": form.u, f"l{side}": form.lam, f"Q{side}": torch.cat([q.reshape(-1) for q in form.q]),
                        f"e{side}": torch.cat(form.e)})
        elif isinstance(form, Structured):
            out.update({f"U{side}": form.u, f"l{side}": form.lam, f"d{side}": form.d})
        else:
            out.update({f"Q{side}": form[0], f"l{side}": form[1]})
    return out


def _gather_grams(layer: Layer, a: torch.Tensor, group: Any) -> torch.Tensor:
    """A hierarchical A held local to its blocks, as every grid keeps it: the sketch, then
    every block's triangle in block order (collective over the spatial group)."""
    assert layer.own is not None and layer.blocks is not None and layer.omega is not None
    n = layer.dim_a * (layer.omega.shape[1] + 1)
    grams = list(torch.split(a[n:], [packed_size(len(b)) for b in layer.leaves]))
    return torch.cat([a[:n]] + local.gather(grams, layer.own.blocks, len(layer.blocks), group))


def _own_part(layer: Layer, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A saved hierarchical A (every block: any grid's state) cut to the blocks this rank
    holds; entries of other sizes are left for ``checked``'s shape check."""
    assert layer.own is not None and layer.blocks is not None and layer.omega is not None
    mine, sizes = layer.own.blocks, [len(b) for b in layer.blocks]
    out = dict(saved)
    n = layer.dim_a * (layer.omega.shape[1] + 1)
    cuts = {"A": (n, [packed_size(k) for k in sizes]), "QA": (0, [k * k for k in sizes]), "eA": (0, sizes)}
    for name, (head, lengths) in cuts.items():
        t = saved.get(name)
        if t is not None and t.dim() == 1 and t.numel() == head + sum(lengths):
            parts = torch.split(t[head:], lengths)
            out[name] = torch.cat([t[:head]] + [parts[j] for j in mine])
    return out


def checked(layer: Layer, saved: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, ...]]]:
    """The saved entry as this rank holds it (its own blocks cut out) and the shape of every
    entry the layer needs; ``ValueError`` naming the layer, the entry and both shapes."""
    if layer.own is not None:
        saved = _own_part(layer, saved)
    want: dict[str, tuple[int, ...]] = {}
    for side in "AG":
        d = layer.dim(side)
        want[side] = layer.shape(side)
        if side == layer.wide == "A" and layer.blocks is not None:
            leaves = layer.leaves
            want.update({f"U{side}": (d, layer.rank), f"l{side}": (layer.rank,),
                         f"Q{side}": (sum(len(b) ** 2 for b in leaves),), f"e{side}": (sum(len(b) for b in leaves),)})
        elif side == layer.wide:
            want.update({f"U{side}": (d, layer.rank), f"l{side}": (layer.rank,), f"d{side}": (d,)})
        else:
            want.update({f"Q{side}": (d, d), f"l{side}": (d,)})
    for name, t in saved.items():
        if name not in want or tuple(t.shape) != want[name]:
            raise ValueError(f"kfac state of '{layer.key}': {name} has shape {tuple(t.shape)}, but the layer "
                             f"needs {want.get(name, 'no such entry')}"
                             + (" (a low-rank factor: kfac.rank, kfac.oversample and kfac.flat_blocks as saved)"
                                if layer.wide is not None else ""))
    return saved, want


def block_memory(layer: Layer, factor: torch.dtype, inverse: torch.dtype) -> dict[str, Any]:
    """A hierarchical A's diagonal blocks on this rank: how many, their bytes
    (``local.block_bytes``), and whether they stay on the ranks that own their features."""
    nbytes = local.block_bytes([len(b) for b in layer.leaves], factor, inverse)
    return {"blocks_held": len(layer.leaves), "blocks_local": layer.own is not None, "block_memory_bytes": nbytes}


def log_blocks(layer: Layer, factor: torch.dtype, inverse: torch.dtype) -> None:
    mem = block_memory(layer, factor, inverse)
    log.info("kfac: layer '%s': A in the hierarchical form, %d diagonal blocks, %d held on this rank (%s), "
             "%.1f MiB per rank", layer.name, len(layer.blocks or []), mem["blocks_held"],
             "local to their blocks: the weight is sharded" if mem["blocks_local"] else
             "every rank holds every block", mem["block_memory_bytes"] / 2**20)


def report(layers: list[Layer], eigen: dict[str, Any], cfg: KFACConfig, factor: torch.dtype, inverse: torch.dtype
           ) -> dict[str, Any]:
    """``KFAC.report``: per low-rank factor its side, width, rank as set and as kept at the
    last inverse update, memory per rank, and a hierarchical A's blocks (``block_memory``)."""
    size = torch.finfo(factor).bits // 8
    wide: dict[str, Any] = {}
    for layer in layers:
        if layer.wide is None:
            continue
        d, other = layer.dim(layer.wide), layer.dim("G" if layer.wide == "A" else "A")
        held = eigen.get(layer.key)
        part = None if held is None else held[0 if layer.wide == "A" else 1]
        wide[layer.name] = {"factor": layer.wide, "width": d, "rank": layer.rank,
                            "kept": part.kept if isinstance(part, (Structured, Blocked, LocalBlocked)) else None,
                            "blocks": len(layer.blocks) if isinstance(part, (Blocked, LocalBlocked)) else 0,
                            "memory_bytes": size * memory_elements(d, other, cfg.rank, cfg.oversample)}
        if layer.wide == "A" and layer.blocks is not None:
            wide[layer.name].update(block_memory(layer, factor, inverse))
    return {"preconditioned": len(layers), "low_rank": wide}
