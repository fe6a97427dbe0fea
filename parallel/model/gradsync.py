"""Gradient synchronisation like DDP: bucketed, overlapped with the backward.

Every parameter gradient on every rank is a partial sum (see ``parallel.comm``), so the
serial gradient of the mean over data groups of their losses is one sum over the spatial
group and a mean over the data group: a sum over all ranks divided by the data size.
A parameter sharded over the spatial group (``spatial_shard``: a Flatten+Linear weight's
block columns, ``parallel.layers.linear``) holds a complete gradient for its shard: it is
only averaged over the data group, in buckets of its own.
Gradients are packed into buckets in reverse registration order (roughly the order the
backward produces them); a bucket's all-reduce starts as soon as its last gradient is
accumulated, in bucket order on every rank, and runs while the backward goes on. The
gradients are views into their bucket's buffer (installed at each forward where
``zero_grad`` left them None), so the all-reduce runs in place and no copy of the
gradients is made; gradients replaced by hand in between go through a packed copy. The
hook of the last gradient waits for all buckets (and writes any copies back), so
``loss.backward()`` returns with synchronised gradients.

The hierarchical sync (``measure=True``, with data and spatial groups of two or more ranks)
forms each data group's gradient on the way, at no extra traffic, for the gradient noise
scale (``parallel.train.observe.noisescale``): a replicated bucket is reduce-scattered over
the spatial group (each rank then holds a shard of its data group's gradient), the shard
all-reduced over the data group (a shard of the global sum), scaled and all-gathered over
the spatial group; per rank that moves ``(S-1)/S + (D-1)/(S D) = (P-1)/P`` of the bucket,
as one all-reduce over all ``P = S D`` ranks does. The squared norms of the data-group
shards are summed as they pass (``small_sq``). Without a spatial split (or for a sharded
bucket) a rank's own gradient is already its data group's: its squared norm is taken
before the all-reduce. The stages of the buckets are launched at points fixed by the
bucket count alone (each launch advances the buckets one and two launches older), so
every rank issues the same collectives in the same order on each group.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch
from torch import nn

from parallel import comm
from parallel.comm.timing import ALLREDUCE, region

HIERARCHICAL, FLAT = "hierarchical", "flat"

log = logging.getLogger("parallel")


class GradSync:
    """Hooks that all-reduce gradients of ``module`` over ``group`` during the backward."""

    def __init__(self, module: nn.Module, group: Any, data_size: int, bucket_mb: float = 25.0,
                 shard_group: Any = None, *, spatial_group: Any = None, spatial_size: int = 1,
                 measure: bool = False) -> None:
        """``group``: every rank (the sum over space, the mean over data); ``shard_group``: the
        data group, for spatially sharded parameters (None: no data parallelism, no sync).
        ``measure``: form each data group's gradient (the hierarchical sync where
        ``spatial_group`` has ``spatial_size`` > 1 ranks) and sum its squared norm
        (``small_norm_sq``); needs two or more data groups (else it is off)."""
        self.group = group
        self.scale = 1.0 / data_size
        self.data_size, self.spatial_size = data_size, spatial_size
        self.measure = bool(measure) and data_size > 1 and shard_group is not None
        hierarchical = self.measure and spatial_size > 1 and spatial_group is not None
        self.enabled = True
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = {id(p): n for n, p in named}
        self.buckets: list[list[nn.Parameter]] = []
        self.groups: list[Any] = []
        self.kinds: list[str] = []
        limit = bucket_mb * 2**20
        size = 0.0
        for _, p in reversed(named):
            sharded = bool(getattr(p, "spatial_shard", False))
            start_new = not self.buckets or size + p.numel() * p.element_size() > limit or \
                self.buckets[-1][0].dtype != p.dtype or self.buckets[-1][0].device != p.device or \
                bool(getattr(self.buckets[-1][0], "spatial_shard", False)) != sharded
            if start_new:
                self.buckets.append([])
                self.groups.append(shard_group if sharded else group)
                self.kinds.append(HIERARCHICAL if hierarchical and not sharded else FLAT)
                size = 0.0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.spatial_group, self.data_group = spatial_group, shard_group
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        # Each bucket's gradients live in one flat buffer (``p.grad`` are views into it, like
        # DDP's gradient_as_bucket_view): the all-reduce runs in place, with no bucket copy.
        # A hierarchical bucket's buffer is padded to a multiple of the spatial size (zeros
        # that stay zero), and its shard has a buffer of its own.
        self.flats: list[torch.Tensor | None] = [None] * len(self.buckets)
        self.shards: list[torch.Tensor | None] = [None] * len(self.buckets)
        # gloo's reduce-scatter goes as messages (parallel.comm.ops): the other ranks' parts land here
        self.pairwise = hierarchical and comm.sends_messages(spatial_group)
        self.recvs: list[torch.Tensor | None] = [None] * len(self.buckets)
        self.small_sq: torch.Tensor | None = None  # this rank's part of the data groups' squared norms
        self.measured = False  # whether the last synced backward summed ``small_sq``
        self.small_total: torch.Tensor | None = None  # its sum over every rank (``small_work`` when done)
        self.small_work: Any = None
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for _, p in named]
        self._reset()

    @property
    def hierarchical(self) -> bool:
        """Whether any bucket takes the hierarchical route."""
        return HIERARCHICAL in self.kinds

    def _padded(self, i: int) -> int:
        n = sum(p.numel() for p in self.buckets[i])
        if self.kinds[i] == HIERARCHICAL:
            return -(-n // self.spatial_size) * self.spatial_size
        return n

    def drop_buffers(self) -> None:
        """Forget the flat gradient buffers (after the parameters changed dtype or device):
        the next forward allocates them anew from the parameters."""
        self.flats = [None] * len(self.buckets)
        self.shards = [None] * len(self.buckets)
        self.recvs = [None] * len(self.buckets)

    def _reset(self) -> None:
        self.pending = [len(b) for b in self.buckets]
        self.ready: set[int] = set()
        self.next_bucket = 0
        # (request, buffer, bucket, in place, kind) of each launched bucket, in launch order
        self.works: list[list[Any]] = []
        self.scattered: list[int] = []  # hierarchical buckets whose reduce-scatter runs (indices into works)
        self.reduced: list[int] = []    # ... whose shard all-reduce runs

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip the sync (gradient accumulation); the next synced backward sums it all."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    def prepare(self) -> None:
        """Called at each forward: a sync left half-done means unused parameters. Gradients
        that are None (after ``zero_grad``) become zeroed views into their bucket."""
        if 0 < len(self.ready) < len(self.bucket_of):
            missing = [self.names[i] for i in self.bucket_of if i not in self.ready]
            self._reset()
            raise RuntimeError(
                f"the last backward produced no gradient for {len(missing)} parameter(s) "
                f"({', '.join(missing[:5])}{'...' if len(missing) > 5 else ''}), so gradients were "
                "not synchronised; freeze them (requires_grad=False) or use them in the forward")
        for i, bucket in enumerate(self.buckets):
            if all(p.grad is not None for p in bucket):
                continue
            flat = self.flats[i]
            if flat is None:
                n = sum(p.numel() for p in bucket)
                flat = self.flats[i] = torch.empty(self._padded(i), dtype=bucket[0].dtype, device=bucket[0].device)
                flat[n:].zero_()
            offset = 0
            for p in bucket:
                n = p.numel()
                if p.grad is None:
                    p.grad = flat[offset:offset + n].view_as(p).zero_()
                offset += n

    def _in_place(self, i: int) -> bool:
        """Whether bucket ``i``'s gradients are all still views into its buffer, in order."""
        flat = self.flats[i]
        if flat is None:
            return False
        offset = 0
        for p in self.buckets[i]:
            g = p.grad
            if g is None or g.data_ptr() != flat[offset:].data_ptr() or not g.is_contiguous():
                return False
            offset += p.numel()
        return True

    def _ready(self, p: torch.Tensor) -> None:
        if not self.enabled:
            return
        key = id(p)
        if key in self.ready:
            return
        self.ready.add(key)
        self.pending[self.bucket_of[key]] -= 1
        while self.next_bucket < len(self.buckets) and self.pending[self.next_bucket] == 0:
            self._launch(self.next_bucket)
            self.next_bucket += 1
        if self.next_bucket == len(self.buckets):
            self._finish()

    def _launch(self, i: int) -> None:
        with region(ALLREDUCE):  # named in traces, timed into the step's breakdown (parallel.comm.timing)
            self._launch_bucket(i)

    def _launch_bucket(self, i: int) -> None:
        bucket = self.buckets[i]
        if i == 0 and self.measure:
            if self.small_work is not None:  # the last step's sum, never read: done before the next starts
                self.small_work.wait()
                self.small_work = None
            self.small_sq = torch.zeros((), dtype=torch.float64, device=bucket[0].device)
            self.measured = False
        in_place = self._in_place(i)
        # Gradients replaced since the forward (set by hand, or no prepare()): a packed copy.
        flat = self.flats[i] if in_place else self._packed(i)
        if self.kinds[i] == HIERARCHICAL:
            shard = self.shards[i]
            if shard is None or shard.dtype != flat.dtype or shard.device != flat.device:
                shard = self.shards[i] = flat.new_empty(flat.numel() // self.spatial_size)
                self.recvs[i] = flat.new_empty(shard.numel() * (self.spatial_size - 1)) if self.pairwise else None
            work = comm.reduce_scatter_async(shard, flat, self.spatial_group, recv=self.recvs[i],
                                             caller="gradsync: reduce-scatter")
            self.scattered.append(len(self.works))
            self.works.append([work, flat, bucket, in_place, i])
        else:
            if self.measure:  # this rank's gradient is its data group's (no split, or a sharded weight)
                self._add_square(flat)
            work = comm.all_reduce_async(flat, self.groups[i]) if self.groups[i] is not None else None
            self.works.append([work, flat, bucket, in_place, i])
        # the older buckets' next stages, at points fixed by the launch count (the same order on every rank)
        while len(self.scattered) > 1:
            self._reduce_shard()
        while len(self.reduced) > 1:
            self._gather_shard()

    def _packed(self, i: int) -> torch.Tensor:
        flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]])  # type: ignore[union-attr]
        pad = self._padded(i) - flat.numel()
        return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat

    def _add_square(self, t: torch.Tensor) -> None:
        # each buffer's norm in its own dtype first (as parallel.train.gradnorm takes them), summed in float64
        self.small_sq += torch.linalg.vector_norm(t).to(torch.float64).square()  # type: ignore[operator]

    def _reduce_shard(self) -> None:
        """The oldest reduce-scatter: its shard (a piece of the data group's gradient) is
        measured and all-reduced over the data group."""
        j = self.scattered.pop(0)
        w = self.works[j]
        w[0].wait()
        shard = self.shards[w[4]]
        self._add_square(shard)  # type: ignore[arg-type]
        w[0] = comm.all_reduce_async(shard, self.data_group,  # type: ignore[arg-type]
                                     caller="gradsync: shard all-reduce")
        self.reduced.append(j)

    def _gather_shard(self) -> None:
        """The oldest shard all-reduce: the mean over data groups, gathered over the spatial group."""
        w = self.works[self.reduced.pop(0)]
        w[0].wait()
        shard = self.shards[w[4]]
        shard.mul_(self.scale)  # type: ignore[union-attr]
        w[0] = comm.all_gather_async(w[1], shard, self.spatial_group,  # type: ignore[arg-type]
                                     caller="gradsync: all-gather")

    def _finish(self) -> None:
        with region(ALLREDUCE):  # the wait for every bucket's all-reduce: what the backward did not hide
            self._finish_buckets()

    def _finish_buckets(self) -> None:
        while self.scattered:
            self._reduce_shard()
        while self.reduced:
            self._gather_shard()
        for work, flat, bucket, in_place, i in self.works:
            if work is not None:
                work.wait()
            if self.kinds[i] == FLAT:
                flat.mul_(self.scale)
            if in_place:
                continue
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p))  # type: ignore[union-attr]
                offset += n
        if self.measure:  # the one-scalar sum over every rank, started now: read by small_norm_sq
            self.small_total = self.small_sq.clone()  # type: ignore[union-attr]
            self.small_work = comm.all_reduce_async(self.small_total, self.group,
                                                    caller="gradsync: the data groups' squared norms")
        self.measured = self.measure
        self._reset()

    def small_norm_sq(self) -> torch.Tensor:
        """The mean over data groups of their gradient's squared norm, float64, the same on
        every rank (one scalar summed over every rank, started when the sync finished). A sharded weight is counted
        once, a replicated one once; the gradients as the backward left them (a loss scale
        still in them). Only after a synced backward with ``measure`` on."""
        if not self.measured or self.small_sq is None:
            raise RuntimeError("gradsync: no data group's gradient was measured in the last backward "
                               f"(measure={self.measure}, data groups {self.data_size})")
        if self.small_work is not None:
            self.small_work.wait()
            self.small_work = None
        return self.small_total / self.data_size

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
