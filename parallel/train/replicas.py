"""Replicas agree, or the job says which rank does not.

Gradients are synchronised so that every copy of a parameter takes the same update: the
data groups hold copies of every parameter, and the ranks of a spatial group hold copies
of every parameter that is not sharded over it (convolution and norm weights, biases, a
replicated Linear; a Flatten+Linear weight marked ``spatial_shard`` holds a different
block of columns on each spatial rank, so only its data-group copies are replicas). A
flipped bit in memory, or a kernel that rounds differently on one rank, makes a copy
drift silently: the job goes on with ranks that no longer train the same model.

Every ``train.replica_check_every`` steps, and before every checkpoint, ``ReplicaCheck``
takes a bit-exact digest of each parameter and each tensor of its optimiser state on
every rank (``digest``), gathers the digests once over the world (one all-gather of 16
bytes a tensor) and compares each tensor over its replicas (``disagreements``, a pure
function every rank evaluates alike). On a mismatch every rank raises
``ReplicaMismatchError`` naming the step, the tensor and the rank that differs from the
majority of its replicas (with two replicas there is no majority: both are named); no
checkpoint is written after it, so the last one on disk is the last taken from agreeing
replicas, and every checkpoint records the check it passed (``record``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from parallel import comm
from parallel.grid import Grid
from parallel.train.observe.events import Observer

log = logging.getLogger("parallel.train")

MAX_NAMED = 5  # disagreeing tensors quoted in the message; the rest are counted


class ReplicaMismatchError(RuntimeError):
    """Copies of a parameter (or of its optimiser state) differ between ranks; raised alike
    on every rank (every rank compares the same gathered digests)."""

    collective = True


@dataclass(frozen=True)
class Tracked:
    """A tensor the check compares: its name in messages, and whether it is sharded over
    the spatial group (then only its data-group copies are replicas)."""

    name: str
    sharded: bool
    tensor: torch.Tensor


def tracked(model: nn.Module, pmodel: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[Tracked]:
    """Every parameter of ``pmodel`` (named as in the serial ``model``) and every tensor of
    its optimiser state (K-FAC's factors too), in the same order on every rank."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: list[Tracked] = []
    for pname, p in pmodel.named_parameters():
        name = names.get(id(p), pname)
        sharded = bool(getattr(p, "spatial_shard", False))
        out.append(Tracked(name, sharded, p.detach()))
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor):
                # a per-parameter scalar (Adam's step count) is a replica on every rank alike
                out.append(Tracked(f"{name} (optimiser {key})", sharded and value.dim() > 0, value.detach()))
    # K-FAC's factors and their eigendecompositions: the same on every rank (parallel.kfac),
    # but for the diagonal blocks a rank holds of a sharded Flatten+Linear (parallel.kfac.local):
    # those, and the factor A that carries them, are replicas over the data group only
    factors, eigen = getattr(optimizer, "factors", None), getattr(optimizer, "eigen", None)
    if isinstance(factors, dict) and isinstance(eigen, dict):
        local = {layer.key for layer in getattr(optimizer, "layers", []) if getattr(layer, "own", None) is not None}
        for key in sorted(factors):
            for part, t in zip(("A", "G"), factors[key]):
                out.append(Tracked(f"{key} (K-FAC factor {part})", key in local and part == "A", t.detach()))
        for key in sorted(eigen):
            for side, held in zip("AG", eigen[key]):
                for part, t in _held(side, held):
                    out.append(Tracked(f"{key} (K-FAC {part})", part.endswith("own blocks)"), t.detach()))
    return out


def _held(side: str, held: Any) -> list[tuple[str, torch.Tensor]]:
    """A K-FAC factor's inverse form as named tensors: a dense eigendecomposition ``(Q, l)``,
    a low-rank plus diagonal form (``u``, ``lam``, ``d``), a blocked one (``u``, ``lam`` and
    each diagonal block's ``q``, ``e``) (``parallel.kfac.lowrank``), or a blocked one whose
    blocks stay on their ranks (``parallel.kfac.local``: ``u``, ``lam``, and the rank's own
    blocks' ``q`` and ``e`` each in one tensor, named "(own blocks)": the same number of
    tensors on every rank however many blocks each holds)."""
    if isinstance(held, (tuple, list)):
        return [(f"Q{side}", held[0]), (f"l{side}", held[1])]
    parts = [(f"U{side}", held.u), (f"l{side}", held.lam)]
    if hasattr(held, "d"):
        return parts + [(f"d{side}", held.d)]
    if hasattr(held, "pos"):
        return parts + [(f"Q{side} (own blocks)", torch.cat([q.reshape(-1) for q in held.q])),
                        (f"e{side} (own blocks)", torch.cat(list(held.e)))]
    return parts + [(f"Q{side}[{i}]", q) for i, q in enumerate(held.q)] + [(f"e{side}[{i}]", e) for i, e in enumerate(held.e)]


def digest(t: torch.Tensor) -> tuple[int, int]:
    """A bit-exact digest of ``t``'s bytes as two int64.

    On the CPU: BLAKE2b of the bytes (about 1 GB/s on one core). Elsewhere (no copy to the
    host): two integer sums over the tensor's bytes read as int32 words, computed on the
    device, exact in any order: ``sum(w)`` and ``sum(lo * (lo + hi))`` (``lo``, ``hi``: the
    word's low and high 16 bits). Any difference confined to one word (one flipped bit)
    changes the first; ulp-sized drifts in many words that cancel in the first change the
    second unless they also cancel there.
    """
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    if flat.device.type == "cpu":
        data = flat.contiguous().view(torch.uint8).numpy() if flat.numel() else None
        h = hashlib.blake2b(memoryview(data).cast("B") if data is not None else b"", digest_size=16).digest()
        return (int.from_bytes(h[:8], "little", signed=True), int.from_bytes(h[8:], "little", signed=True))
    s = device_sums(flat)
    return int(s[0]), int(s[1])


def device_sums(flat: torch.Tensor) -> torch.Tensor:
    """``digest``'s integer form, on ``flat``'s device: (2,) int64. Without overflow for
    tensors below 2^31 bytes (each product below 2^32, the sums below 2^63)."""
    raw = flat.contiguous()
    nbytes = raw.numel() * raw.element_size()
    words = raw.view(torch.uint8)
    if nbytes % 4 == 0:
        words = raw.view(torch.uint8).view(torch.int32)
    x = words.to(torch.int64)
    lo, hi = x & 0xFFFF, x >> 16
    return torch.stack([x.sum(), (lo * (lo + hi)).sum()])


def digests(items: Sequence[Tracked]) -> torch.Tensor:
    """(K, 2) int64 on the CPU: ``digest`` of each tracked tensor."""
    return torch.tensor([digest(t.tensor) for t in items], dtype=torch.int64).reshape(len(items), 2)


@dataclass(frozen=True)
class Disagreement:
    """One tensor whose copies differ: ``odd`` are the ranks that differ from the majority
    of ``replicas`` (every rank holding a copy; with no majority, every rank of the copies
    that differ from the lowest rank's, and that rank too)."""

    name: str
    replicas: tuple[int, ...]
    odd: tuple[int, ...]
    majority: bool


def replica_sets(sharded: bool, spatial_size: int, data_size: int) -> list[tuple[int, ...]]:
    """The ranks holding copies of one tensor: all of them, or, for one sharded over the
    spatial group, those at the same spatial rank (``rank = data_rank * spatial_size +
    spatial_rank``, ``parallel.grid``)."""
    if not sharded:
        return [tuple(range(spatial_size * data_size))]
    return [tuple(d * spatial_size + s for d in range(data_size)) for s in range(spatial_size)]


def disagreements(table: torch.Tensor, items: Sequence[tuple[str, bool]], spatial_size: int,
                  data_size: int) -> list[Disagreement]:
    """Which tensors' copies differ, and which ranks hold the odd ones out.

    ``table``: (world, K, 2) digests of every rank; ``items``: each tensor's (name,
    sharded). A pure function of what every rank gathered: every rank finds the same.
    """
    by_rank = [[tuple(d) for d in table[r].tolist()] for r in range(table.shape[0])]  # [rank][tensor]
    found = []
    for k, (name, sharded) in enumerate(items):
        for ranks in replica_sets(sharded, spatial_size, data_size):
            if len(ranks) < 2:
                continue
            seen = [by_rank[r][k] for r in ranks]
            counts = Counter(seen).most_common()
            if len(counts) == 1:
                continue
            if counts[0][1] > len(ranks) // 2:  # a strict majority: the others are odd
                odd = tuple(r for r, d in zip(ranks, seen) if d != counts[0][0])
                found.append(Disagreement(name, ranks, odd, True))
            else:  # two replicas (or a tie): which copy is wrong cannot be told
                odd = tuple(r for r, d in zip(ranks, seen) if d != seen[0])
                found.append(Disagreement(name, ranks, (ranks[0], *odd), False))
    return found


def describe(step: int, found: Sequence[Disagreement], world: int) -> str:
    """The message of a failed check: the step, the tensors, the ranks."""
    blamed = Counter(r for d in found for r in d.odd if d.majority)
    lines = []
    for d in found[:MAX_NAMED]:
        group = "every rank" if len(d.replicas) == world else f"ranks {list(d.replicas)}"
        if d.majority:
            who = ", ".join(f"rank {r}" for r in d.odd)
            lines.append(f"'{d.name}': {who} differs from the other {len(d.replicas) - len(d.odd)} copies "
                         f"(copies on {group})")
        else:
            lines.append(f"'{d.name}': ranks {list(d.odd)} hold different copies and no majority says which "
                         f"is wrong (copies on {group})")
    more = f" (and {len(found) - MAX_NAMED} more)" if len(found) > MAX_NAMED else ""
    head = f"step {step}: replicas disagree in {len(found)} tensor(s){more}"
    if blamed:
        head += f"; the odd rank: {', '.join(f'rank {r}' for r, _ in blamed.most_common())}"
    return head + ":\n  " + "\n  ".join(lines)


class ReplicaCheck(Observer):
    """The check as an observer of the run: every ``every`` steps (0: never), at
    ``step_end``; ``record(progress)`` runs it before a checkpoint (``every`` > 0) and
    says what the checkpoint records. Collective: every rank calls it alike.

    ``last_good()``: which checkpoint the run can go back to (for the message).
    """

    def __init__(self, every: int, grid: Grid, model: nn.Module, pmodel: nn.Module,
                 optimizer: torch.optim.Optimizer | None, last_good: Callable[[], str]) -> None:
        self.every, self.grid, self.model, self.pmodel, self.optimizer = every, grid, model, pmodel, optimizer
        self.last_good = last_good
        self.checked_step: int | None = None
        self.count = 0
        self.seconds = 0.0

    def check(self, step: int) -> None:
        """Compare every tracked tensor over its replicas now (after ``step``); raise
        ``ReplicaMismatchError`` on every rank if any copy differs."""
        if self.checked_step == step:
            return
        t0 = time.perf_counter()
        g = self.grid
        found: list[Disagreement] = []
        if g.world_size > 1:  # one rank holds no copies: nothing to compare
            items = tracked(self.model, self.pmodel, self.optimizer)
            mine = digests(items)
            parts = comm.all_gather_varlen(mine.to(g.device), g.world_group, caller="replicas.check")
            if len({p.shape[0] for p in parts}) > 1:
                raise ReplicaMismatchError(
                    f"step {step}: ranks track different numbers of tensors "
                    f"({[p.shape[0] for p in parts]}: parameters and optimiser state); {self.last_good()}")
            table = torch.stack([p.cpu() for p in parts])
            found = disagreements(table, [(t.name, t.sharded) for t in items], g.spatial_size, g.data_size)
        self.count += 1
        self.seconds += time.perf_counter() - t0
        if found:
            raise ReplicaMismatchError(f"{describe(step, found, g.world_size)}\nstopping: {self.last_good()}")
        self.checked_step = step

    def record(self, progress: Any) -> dict[str, Any]:
        """What a checkpoint written now records: the check it passed (run here if it has not
        run at this step), or that none ran (``train.replica_check_every=0``)."""
        if self.every <= 0:
            return {"checked": False}
        self.check(progress.step)
        return {"checked": True, "agree": True, "step": progress.step, "world_size": self.grid.world_size}

    def costs(self) -> dict[str, Any]:
        """The summary's ``replica_checks``: how many ran this session and their seconds."""
        return {"every": self.every, "count": self.count, "seconds": self.seconds,
                "seconds_each": self.seconds / max(self.count, 1)}

    def step_end(self, progress: Any, loss: Any, stats: Any) -> None:
        if self.every > 0 and progress.step % self.every == 0:
            self.check(progress.step)
