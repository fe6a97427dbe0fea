"""Gradient synchronisation like DDP: bucketed, overlapped with the backward.

Every parameter gradient on every rank is a partial sum (see ``parallel.comm``), so the
serial gradient of the mean over data groups of their losses is one sum over the spatial
group and a mean over the data group: a sum over all ranks divided by the data size.
Gradients are packed into buckets in reverse registration order (roughly the order the
backward produces them); a bucket's all-reduce starts as soon as its last gradient is
accumulated, in bucket order on every rank, and runs while the backward goes on. The
hook of the last gradient waits for all buckets and writes the results back, so
``loss.backward()`` returns with synchronised gradients.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger("parallel")


class GradSync:
    """Hooks that all-reduce gradients of ``module`` over ``group`` during the backward."""

    def __init__(self, module: nn.Module, group: Any, data_size: int, bucket_mb: float = 25.0) -> None:
        self.group = group
        self.scale = 1.0 / data_size
        self.enabled = True
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = {id(p): n for n, p in named}
        self.buckets: list[list[nn.Parameter]] = []
        limit = bucket_mb * 2**20
        size = 0.0
        for _, p in reversed(named):
            start_new = not self.buckets or size + p.numel() * p.element_size() > limit or \
                self.buckets[-1][0].dtype != p.dtype or self.buckets[-1][0].device != p.device
            if start_new:
                self.buckets.append([])
                size = 0.0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for _, p in named]
        self._reset()

    def _reset(self) -> None:
        self.pending = [len(b) for b in self.buckets]
        self.ready: set[int] = set()
        self.next_bucket = 0
        self.works: list[tuple[Any, torch.Tensor, list[nn.Parameter]]] = []

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip the sync (gradient accumulation); the next synced backward sums it all."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    def prepare(self) -> None:
        """Called at each forward: a sync left half-done means unused parameters."""
        if 0 < len(self.ready) < len(self.bucket_of):
            missing = [self.names[i] for i in self.bucket_of if i not in self.ready]
            self._reset()
            raise RuntimeError(
                f"the last backward produced no gradient for {len(missing)} parameter(s) "
                f"({', '.join(missing[:5])}{'...' if len(missing) > 5 else ''}), so gradients were "
                "not synchronised; freeze them (requires_grad=False) or use them in the forward")

    def _ready(self, p: torch.Tensor) -> None:
        if not self.enabled:
            return
        key = id(p)
        if key in self.ready:
            return
        self.ready.add(key)
        self.pending[self.bucket_of[key]] -= 1
        while self.next_bucket < len(self.buckets) and self.pending[self.next_bucket] == 0:
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1
        if self.next_bucket == len(self.buckets):
            self._finish()

    def _launch(self, bucket: list[nn.Parameter]) -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])  # type: ignore[union-attr]
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self.works.append((work, flat, bucket))

    def _finish(self) -> None:
        for work, flat, bucket in self.works:
            work.wait()
            flat.mul_(self.scale)
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p))  # type: ignore[union-attr]
                offset += n
        self._reset()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
