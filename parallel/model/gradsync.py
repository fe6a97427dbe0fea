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
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch
from torch import nn

from parallel import comm
from parallel.comm.timing import ALLREDUCE, region

log = logging.getLogger("parallel")


class GradSync:
    """Hooks that all-reduce gradients of ``module`` over ``group`` during the backward."""

    def __init__(self, module: nn.Module, group: Any, data_size: int, bucket_mb: float = 25.0,
                 shard_group: Any = None) -> None:
        """``group``: every rank (the sum over space, the mean over data); ``shard_group``: the
        data group, for spatially sharded parameters (None: no data parallelism, no sync)."""
        self.group = group
        self.scale = 1.0 / data_size
        self.enabled = True
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = {id(p): n for n, p in named}
        self.buckets: list[list[nn.Parameter]] = []
        self.groups: list[Any] = []
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
                size = 0.0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        # Each bucket's gradients live in one flat buffer (``p.grad`` are views into it, like
        # DDP's gradient_as_bucket_view): the all-reduce runs in place, with no bucket copy.
        self.flats: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for _, p in named]
        self._reset()

    def drop_buffers(self) -> None:
        """Forget the flat gradient buffers (after the parameters changed dtype or device):
        the next forward allocates them anew from the parameters."""
        self.flats = [None] * len(self.buckets)

    def _reset(self) -> None:
        self.pending = [len(b) for b in self.buckets]
        self.ready: set[int] = set()
        self.next_bucket = 0
        self.works: list[tuple[Any, torch.Tensor, list[nn.Parameter], bool]] = []

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
                flat = self.flats[i] = torch.empty(sum(p.numel() for p in bucket), dtype=bucket[0].dtype,
                                                   device=bucket[0].device)
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
        in_place = self._in_place(i)
        # Gradients replaced since the forward (set by hand, or no prepare()): a packed copy.
        flat = self.flats[i] if in_place else torch.cat([p.grad.reshape(-1) for p in bucket])  # type: ignore[union-attr]
        work = comm.all_reduce_async(flat, self.groups[i]) if self.groups[i] is not None else None
        self.works.append((work, flat, bucket, in_place))

    def _finish(self) -> None:
        with region(ALLREDUCE):  # the wait for every bucket's all-reduce: what the backward did not hide
            self._finish_buckets()

    def _finish_buckets(self) -> None:
        for work, flat, bucket, in_place in self.works:
            if work is not None:
                work.wait()
            flat.mul_(self.scale)
            if in_place:
                continue
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p))  # type: ignore[union-attr]
                offset += n
        self._reset()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
