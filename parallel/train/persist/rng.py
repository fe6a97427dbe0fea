"""The layout of a rank's RNG streams in a checkpoint: torch's CPU stream, CUDA's, then
the model's dropout generators (``parallel.layers.dropout.generators``), as one flat
uint8 tensor per rank (``rng_state``); ``set_rng_state`` checks a saved layout against
this process's streams before setting any; ``restore_rng`` restores them at the same
world and split, else reseeds. ``parallel.train.persist.checkpoint`` gathers and saves them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from parallel.grid import Grid
from parallel.layers.dropout import generators

log = logging.getLogger("parallel.train")


def rng_state(model: nn.Module | None = None) -> torch.Tensor:
    """This rank's RNG streams as one uint8 tensor: torch's CPU RNG, CUDA's, the model's."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available():
        states.append(torch.cuda.get_rng_state())
    states += [g.get_state() for g in generators(model)]
    return torch.cat([s.cpu().view(torch.uint8).flatten() for s in states])


class RngLayoutError(ValueError):
    """Saved RNG streams that do not fit this process (another device kind, model or format)."""


def set_rng_state(state: torch.Tensor, model: nn.Module | None = None) -> None:
    """Inverse of ``rng_state``. The bytes are taken to the CPU first (a checkpoint loaded
    with ``map_location`` on a GPU brings them there; torch's setters take CPU bytes), and
    the whole layout is checked before any stream is set, so a foreign layout raises
    ``RngLayoutError`` and leaves every stream as it was."""
    if not isinstance(state, torch.Tensor) or state.device.type == "meta":
        raise RngLayoutError(f"the saved RNG state holds no bytes ({type(state).__name__} on "
                             f"{getattr(state, 'device', 'no device')})")
    if state.dtype != torch.uint8 or state.dim() != 1:
        raise RngLayoutError(f"the saved RNG state is {state.dtype} of shape {tuple(state.shape)}, "
                             "not a flat uint8 tensor")
    state = state.detach().to("cpu")
    setters = [(torch.set_rng_state, torch.get_rng_state().numel(), "torch's CPU stream")]
    if torch.cuda.is_available():
        setters.append((torch.cuda.set_rng_state, torch.cuda.get_rng_state().numel(), "the CUDA stream"))
    for g in generators(model):
        setters.append((g.set_state, g.get_state().numel(), f"a {g.device.type} dropout generator"))
    need = sum(n for _, n, _ in setters)
    if state.numel() != need:
        parts = ", ".join(f"{what} {n}" for _, n, what in setters)
        raise RngLayoutError(f"the saved RNG state holds {state.numel()} bytes, this process's streams "
                             f"take {need} ({parts})")
    offset = 0
    for setter, n, _ in setters:
        setter(state[offset:offset + n].clone())
        offset += n


def restore_rng(ckpt: dict[str, Any], grid: Grid, seed: int, model: nn.Module | None = None) -> bool:
    """Restore this rank's RNG streams if the world, the split and the streams' layout
    match; else reseed deterministically (from ``seed``, the step and the data group) with a
    warning. True if restored."""
    rng = ckpt.get("rng") or {}
    same = rng.get("world_size") == grid.world_size and list(rng.get("spatial", [])) == list(grid.spatial)
    if same and "states" in rng:
        try:
            set_rng_state(rng["states"][grid.rank], model)
            return True
        except (RngLayoutError, IndexError, TypeError) as err:
            log.warning("checkpoint RNG streams do not fit this process (%s; written on another kind of "
                        "device?): reseeded, so the run continues correctly but not bit for bit", err)
    else:
        log.warning("checkpoint RNG streams are from a world of %s ranks split %s, this is %s split %s: "
                    "dropout is reseeded, so the run continues correctly but not bit for bit",
                    rng.get("world_size"), rng.get("spatial"), grid.world_size, list(grid.spatial))
    # alike on the ranks of a spatial group (parallel.model.random_draws): batch-shaped draws stay the serial run's
    torch.manual_seed(seed + 7919 * (int(ckpt.get("step", 0)) + 1) + grid.data_rank)
    return False
