"""Training batches copied to the GPU ahead of use, on a side stream.

The loader's workers hand over batches in pinned (page-locked) host memory
(``parallel.data.make_loader`` pins where CUDA is present). Copied on the compute stream
when the step takes them, the copy waits behind the previous step's kernels and the step
waits for the copy. ``AheadCopies`` starts the copy of the next batch on a stream of its
own while the current step runs, and the step's stream waits only for that batch's copy
(a CUDA event), never for the host. On the CPU batches go through unchanged
(``copies_ahead``: only CUDA devices copy ahead).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch


def copies_ahead(device: torch.device | None) -> bool:
    """Whether batches for ``device`` are copied ahead on a side stream (CUDA only; a CPU
    step reads the loader's tensors where they are)."""
    return device is not None and device.type == "cuda"


class AheadCopies:
    """``(fields, stats)`` of ``source``, with ``fields`` on ``device``, each batch's copy
    started one step ahead on a side stream."""

    def __init__(self, source: Iterable[tuple[dict[str, torch.Tensor], Any]], device: torch.device) -> None:
        self.source, self.device = source, device

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], Any]]:
        stream = torch.cuda.Stream(self.device)
        pending = None
        for item in self.source:
            started = self._start(item, stream)
            if pending is not None:
                yield self._ready(pending)
            pending = started
        if pending is not None:
            yield self._ready(pending)

    def _start(self, item: tuple[dict[str, torch.Tensor], Any], stream: Any) -> tuple:
        fields, stats = item
        with torch.cuda.stream(stream):
            moved = {k: v.to(self.device, non_blocking=True) for k, v in fields.items()}
            done = torch.cuda.Event()
            done.record(stream)
        return moved, stats, done

    def _ready(self, pending: tuple) -> tuple[dict[str, torch.Tensor], Any]:
        moved, stats, done = pending
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        for v in moved.values():
            v.record_stream(current)  # the allocator keeps the memory until the step's kernels are done with it
        return moved, stats
