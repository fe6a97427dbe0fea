"""Activation checkpointing per block: keep a block's input, recompute the rest in the backward.

``checkpoint_blocks(model)`` marks the blocks of a (serial or parallelised) model and runs
each under ``torch.utils.checkpoint`` (non-reentrant). A block is

- a run of an ``nn.Sequential``'s children ending at a pooling layer, where the
  Sequential holds pooling layers (CosmoFlow's conv -> activation -> pool blocks);
- otherwise a module (not the root) with a convolution among its direct children
  (the U-Net's conv blocks and up blocks), its descendants then included.

Nothing changes but memory and time: the module tree and ``state_dict`` keys stay as they
are (forwards are patched, not wrapped), and the recomputation replays exactly what the
forward did: the global RNG (torch's ``preserve_rng_state``), the private dropout
generators of spatial layers and the shape cache are rewound to the block's entry, and
buffers (BatchNorm running statistics) are put back afterwards, so they are updated once.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from parallel.layers.base import SpatialMixin
from parallel.layers.dropout import generators as _generators

POOLS = (nn.MaxPool3d, nn.AvgPool3d)
CONVS = (nn.Conv3d, nn.ConvTranspose3d)


def _tracker(module: nn.Module) -> Any:
    for m in module.modules():
        if isinstance(m, SpatialMixin):
            return m.shapes
    return None


def _recomputed(run: Callable[..., Any], owner: nn.Module) -> Callable[..., Any]:
    """``run`` under checkpoint, replaying RNG, shape cache and buffers on recomputation."""

    def forward(*args: Any) -> Any:
        if not torch.is_grad_enabled() or not any(isinstance(a, torch.Tensor) and a.requires_grad
                                                  for a in (*args, *owner.parameters())):
            return run(*args)
        gens = _generators(owner)
        entry = [g.get_state() for g in gens]
        tracker = _tracker(owner)
        shapes = tracker.state() if tracker is not None else None
        calls = [0]

        def body(*inner: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1:
                return run(*inner)
            now = [g.get_state() for g in gens]
            buffers = [b.detach().clone() for b in owner.buffers()]
            for g, s in zip(gens, entry):
                g.set_state(s)
            try:
                if tracker is not None:
                    with tracker.replay(shapes):
                        return run(*inner)
                return run(*inner)
            finally:
                for g, s in zip(gens, now):
                    g.set_state(s)
                with torch.no_grad():
                    for b, saved in zip(owner.buffers(), buffers):
                        b.copy_(saved)

        # Recompute whole blocks: stopping early could cut a halo exchange in two.
        with set_checkpoint_early_stop(False):
            return checkpoint(body, *args, use_reentrant=False, preserve_rng_state=True)

    return forward


def _segments(seq: nn.Sequential) -> list[list[nn.Module]]:
    out: list[list[nn.Module]] = [[]]
    for child in seq:
        out[-1].append(child)
        if isinstance(child, POOLS):
            out.append([])
    return [s for s in out if s]


def _patch_sequential(seq: nn.Sequential) -> int:
    parts = _segments(seq)

    def make(part: list[nn.Module]) -> Callable[..., Any]:
        holder = nn.ModuleList(part)  # for parameters/buffers/generators; not registered on seq

        def run(x: Any) -> Any:
            for m in part:
                x = m(x)
            return x

        return _recomputed(run, holder)

    runs = [make(p) for p in parts]

    def forward(self: nn.Sequential, x: Any) -> Any:
        for r in runs:
            x = r(x)
        return x

    seq.forward = types.MethodType(forward, seq)  # type: ignore[method-assign]
    return len(parts)


def _patch_module(module: nn.Module) -> None:
    original = module.forward
    module.forward = _recomputed(original, module)  # type: ignore[method-assign]


def _visit(model: nn.Module, on_sequential: Callable[[str, nn.Sequential], None],
           on_module: Callable[[str, nn.Module], None]) -> None:
    """Call ``on_sequential`` for each Sequential cut at its pools and ``on_module`` for each
    module block (see the module docstring), with their qualified names."""

    def visit(name: str, module: nn.Module, root: bool) -> None:
        children = list(module.named_children())
        if isinstance(module, nn.Sequential) and any(isinstance(c, POOLS) for _, c in children):
            on_sequential(name, module)
            return
        if not root and any(isinstance(c, CONVS) for _, c in children):
            on_module(name, module)
            return
        for child_name, c in children:
            visit(f"{name}.{child_name}" if name else child_name, c, False)

    visit("", model, True)


def checkpoint_blocks(model: nn.Module) -> int:
    """Recompute each block of ``model`` in the backward; returns the number of blocks."""
    count = 0

    def sequential(_: str, seq: nn.Sequential) -> None:
        nonlocal count
        count += _patch_sequential(seq)

    def module(_: str, m: nn.Module) -> None:
        nonlocal count
        _patch_module(m)
        count += 1

    _visit(model, sequential, module)
    return count


def block_leaves(model: nn.Module) -> list[list[str]]:
    """The qualified names of the leaf modules of each block ``checkpoint_blocks`` would make,
    in order (for ``parallel.plan``'s memory model)."""
    blocks: list[list[str]] = []

    def leaves(prefix: str, m: nn.Module) -> list[str]:
        found = [f"{prefix}.{n}" if n else prefix for n, c in m.named_modules() if not list(c.children())]
        return [f for f in found if f]

    def sequential(name: str, seq: nn.Sequential) -> None:
        blocks.append([])
        for child_name, child in seq.named_children():
            blocks[-1] += leaves(f"{name}.{child_name}" if name else child_name, child)
            if isinstance(child, POOLS):
                blocks.append([])
        if not blocks[-1]:
            blocks.pop()

    def module(name: str, m: nn.Module) -> None:
        blocks.append(leaves(name, m))

    _visit(model, sequential, module)
    return blocks
