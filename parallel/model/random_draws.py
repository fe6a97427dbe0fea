"""Random draws in a model's forward under a spatial split.

The ranks of a spatial group run one sample together, so torch's global generator must
give them the numbers the serial run draws: every rank of the group is seeded alike (by
its data group, ``stream_seed``), and the framework's own checks leave the stream where
they found it (``SameStream``). Then a draw shaped by the batch, as stochastic depth
draws one number per sample (MONAI's EfficientNet ``drop_connect``, ``torch.rand`` of
shape (N, 1, 1, 1, 1)), equals the serial run's on every rank.

A draw shaped like the volume (``torch.randn_like(x)`` of a split block, ``F.dropout`` in
a model's own forward) cannot: each rank draws a block-sized tensor from the start of
the same stream, where the serial run draws the whole volume. ``DrawRecorder`` (a
``TorchDispatchMode``: every aten op tagged ``nondeterministic_seeded``) notes each draw
and the module whose forward made it; ``parallel.verify`` compares the split model's
draws with the serial model's (``mismatch``), and the training pre-flight traces the
serial model on the meta device and refuses draws shaped like a split volume
(``check_model``), naming the module. The framework's spatial dropout layers draw from
streams of their own (``parallel.layers.dropout``) and are not counted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from parallel.model.trace import meta_copy, trace

log = logging.getLogger("parallel")

# Layers that parallelize converts to dropout with streams of its own (parallel.layers.dropout).
OWN_STREAM = (nn.Dropout, nn.Dropout3d)

ADVICE = ("the ranks of a spatial group draw from the serial run's global stream, and a draw shaped "
          "like the split volume takes a block's worth of numbers where the serial run takes the whole "
          "volume's, so no block gets the serial run's noise: draw per sample or channel (shape "
          "(N, C, 1, 1, 1)), use nn.Dropout/nn.Dropout3d modules (converted to per-block streams), or "
          "turn the noise off under a spatial split")


def stream_seed(seed: int, data_rank: int) -> int:
    """The global generator's seed for a data group: alike on every rank of its spatial
    group, and data group 0's equals the serial run's (``seed + 7919``)."""
    return seed + 7919 * (data_rank + 1)


@dataclass(frozen=True)
class Draw:
    """One random draw of a forward."""

    module: str      # the module whose forward drew ('<model>' for the top level)
    cls: str         # its class
    op: str          # the aten op
    shape: tuple[int, ...]
    replicated: bool  # drawn like a tensor that is whole on every rank (after a global pool)

    def describe(self) -> str:
        return f"{self.op} of shape {list(self.shape)} in the forward of '{self.module}' ({self.cls})"


class DrawRecorder(TorchDispatchMode):
    """Records the random draws of the forwards of ``model`` run inside it.

    Draws inside the framework's spatial layers and inside dropout modules that
    ``parallelize`` converts are left out (their streams are their own).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        from parallel.layers.base import SpatialMixin

        self.draws: list[Draw] = []
        self._stack: list[tuple[str, str, bool]] = []
        self._hooks = []
        for name, m in model.named_modules():
            own = isinstance(m, (SpatialMixin, *OWN_STREAM))
            entry = (name or "<model>", type(m).__name__, own)
            self._hooks.append(m.register_forward_pre_hook(lambda _m, _i, e=entry: self._stack.append(e)))
            self._hooks.append(m.register_forward_hook(self._leave))

    def _leave(self, _m: nn.Module, _inputs: Any, _out: Any) -> None:
        if self._stack:  # returns None: a forward hook's value would replace the output
            self._stack.pop()

    def __exit__(self, *exc: Any) -> Any:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if torch.Tag.nondeterministic_seeded in func.tags and isinstance(out, torch.Tensor):
            if any(own for _, _, own in self._stack):
                return out
            from parallel.layers.replicated import is_replicated

            module, cls = (self._stack[-1][0], self._stack[-1][1]) if self._stack else ("<model>", "?")
            inputs = [a for a in args if isinstance(a, torch.Tensor)]
            self.draws.append(Draw(module, cls, str(func.overloadpacket.__name__), tuple(out.shape),
                                   any(is_replicated(a) for a in inputs)))
        return out


def mismatch(serial: list[Draw], split: list[Draw]) -> str | None:
    """Where the split model's draws stop following the serial model's: the first draw of
    another shape or op (a draw shaped like the split volume), or a missing or extra one."""
    for i, (a, b) in enumerate(zip(serial, split)):
        if a.op != b.op or a.shape != b.shape:
            return (f"random draw {i + 1} of the forward, {b.describe()}, is shaped like the split volume "
                    f"(the serial model draws {list(a.shape)})")
    if len(serial) != len(split):
        extra = split[len(serial)] if len(split) > len(serial) else serial[len(split)]
        return (f"the split model draws {len(split)} times where the serial model draws {len(serial)} "
                f"(first unmatched: {extra.describe()})")
    return None


def check_split_draws(serial: list[Draw], split: list[Draw], grid: Any, where: str,
                      error: type[Exception] = ValueError) -> None:
    """Raise ``error`` where the split model's draws stop following the serial model's
    (``mismatch``). Collective over the grid's world: one verdict on every rank."""
    from parallel import comm

    found = mismatch(serial, split)
    flag = torch.tensor([0.0 if found is None else 1.0], dtype=torch.float64, device=grid.device)
    if grid.world_size > 1:
        comm.all_reduce_(flag, grid.world_group, "max", caller="parallel.model.random_draws")
    if float(flag) > 0:
        raise error(f"verification failed at spatial {grid.spatial} {where}: {found or 'another rank drew random numbers shaped like its block'}."
                    f" Why: {ADVICE}.")


def volume_draws(draws: list[Draw], spatial: Sequence[int]) -> list[Draw]:
    """The draws of a serial forward that a split along ``spatial`` cannot reproduce: 5-D,
    not drawn like a replicated tensor, with more than one voxel along a split dim."""
    return [d for d in draws if len(d.shape) == 5 and not d.replicated
            and any(parts > 1 and n > 1 for n, parts in zip(d.shape[2:], spatial))]


def check_model(model: nn.Module, in_shape: Sequence[int], spatial: Sequence[int],
                error: type[Exception] = ValueError) -> list[Draw]:
    """Raise ``error`` naming the module when the serial ``model``'s training forward draws
    random numbers shaped like the volume split ``spatial`` ways (a forward on the meta
    device: no memory, no compute). ``in_shape`` is one sample's (C, D, H, W). Returns the
    draws seen; a model that does not run on the meta device is let through (verification
    against the serial model still compares its draws)."""
    if all(int(s) == 1 for s in spatial):
        return []
    dry = meta_copy(model).train()
    for m in dry.modules():  # no draws in batch norm; a batch of one would stop its training forward
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    try:
        with DrawRecorder(dry) as recorder:
            trace(dry, tuple(int(v) for v in in_shape))
    except Exception as err:  # noqa: BLE001 - the shape checks report a model that cannot run
        log.debug("random draws not checked: the model does not run on the meta device (%s)", err)
        return []
    bad = volume_draws(recorder.draws, spatial)
    if bad:
        raise error(f"{bad[0].describe()} draws random numbers shaped like the volume, which "
                    f"parallel.spatial={list(spatial)} splits: {ADVICE}")
    return recorder.draws


class SameStream:
    """Runs of a check that each start from the global stream as it was on entry, and
    leave it so: the check draws what the model would, and training draws what it would
    have without the check (CPU generator, and the device's where it is a GPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device if device.type == "cuda" else None

    def __enter__(self) -> "SameStream":
        self._cpu = torch.get_rng_state()
        self._gpu = torch.cuda.get_rng_state(self.cuda) if self.cuda is not None else None
        return self

    def restart(self) -> None:
        """Back to the stream as it was on entry."""
        torch.set_rng_state(self._cpu)
        if self._gpu is not None:
            torch.cuda.set_rng_state(self._gpu, self.cuda)

    def __exit__(self, *exc: Any) -> None:
        self.restart()

