"""Collectives and point-to-point messages without autograd: the only calls into
torch.distributed's communication functions in the framework.

Every function checks the tensors it is handed against the group (``checks``) and
creates its own bookkeeping tensors (sizes, padded buffers) on the group's device. A
``group`` is a process group (``grid.spatial_group`` ...) or None for the default (world)
group, as in torch.distributed; without a running process group, or on a group of one,
nothing is sent and tensors come back as they are.

Every request is waited for before a function returns (``exchange`` waits for every
isend/irecv; ``all_reduce_async`` hands its request to the caller, who must wait), so
no message is in flight when a caller moves on or the group is torn down.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Sequence

import torch
import torch.distributed as dist

from parallel.comm.checks import (
    CommError,
    caller_name,
    check_for_group,
    group_backend,
    group_device,
    group_size,
    initialized,
)
from parallel.comm.timing import HALO, region

Op = Literal["sum", "avg", "max", "min"]
_MAX_DIMS = 8  # all_gather_varlen's header: the number of dims, then up to 8 sizes


class _Done:
    """The request of a collective that had nothing to do (a group of one)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _reduce_op(op: str, t: torch.Tensor, caller: str | None) -> Any:
    if op in ("sum", "avg"):
        if op == "avg" and not t.dtype.is_floating_point:
            raise CommError(f"{caller or caller_name()}: op='avg' needs a floating-point tensor, got {t.dtype}")
        return dist.ReduceOp.SUM  # avg = sum / size: gloo has no AVG
    if op == "max":
        return dist.ReduceOp.MAX
    if op == "min":
        return dist.ReduceOp.MIN
    raise CommError(f"{caller or caller_name()}: op={op!r}; choose 'sum', 'avg', 'max' or 'min'")


def all_reduce_(t: torch.Tensor, group: Any, op: Op = "sum", *, caller: str | None = None) -> torch.Tensor:
    """Reduce ``t`` in place over ``group`` (``op``: sum, avg, max or min); returns ``t``."""
    if not initialized():
        return t
    check_for_group(t, group, caller)
    reduce_op = _reduce_op(op, t, caller)
    size = group_size(group)
    if size > 1:
        dist.all_reduce(t, op=reduce_op, group=group)
        if op == "avg":
            t.div_(size)
    return t


def all_reduce_async(t: torch.Tensor, group: Any, *, caller: str | None = None) -> Any:
    """Start summing ``t`` in place over ``group``; returns the request, whose ``wait()``
    the caller must call before reading ``t`` (or tearing the group down)."""
    if not initialized():
        return _Done()
    check_for_group(t, group, caller)
    if group_size(group) == 1:
        return _Done()
    return dist.all_reduce(t, group=group, async_op=True)


class _Pairwise:
    """The request of a reduce-scatter or all-gather made of point-to-point messages: ``wait``
    waits for every message, then runs ``then`` (the sum of the received parts)."""

    def __init__(self, requests: list[Any], then: Any = None) -> None:
        self.requests, self.then = requests, then

    def wait(self) -> bool:
        for r in self.requests:
            r.wait()
        self.requests = []
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True

    def is_completed(self) -> bool:
        return not self.requests and self.then is None


# Backends on which reduce-scatter and all-gather go as point-to-point messages (gloo: its own
# reduce-scatter took 3x the time of the messages on a 2-core host, 8 MiB over 2 ranks); the
# others (NCCL) take the backend's collective. A test empties it to run that path on gloo.
MESSAGES_ON = ("gloo",)


def sends_messages(group: Any) -> bool:
    """Whether reduce-scatter and all-gather over ``group`` go as point-to-point messages."""
    return any(b in group_backend(group) for b in MESSAGES_ON)


def _pairwise(group: Any) -> tuple[list[int], int] | None:
    """(the group's global ranks, this rank's index) where reduce-scatter and all-gather go
    as point-to-point messages (``MESSAGES_ON``); None: the backend's collective."""
    if not sends_messages(group):
        return None
    ranks = dist.get_process_group_ranks(group)
    return ranks, ranks.index(dist.get_rank())


def reduce_scatter_async(out: torch.Tensor, t: torch.Tensor, group: Any, *, recv: torch.Tensor | None = None,
                         caller: str | None = None) -> Any:
    """Start summing ``t`` over ``group`` into ``out``, this rank's part: ``t`` holds
    ``group size`` equal parts, rank i of the group gets the sum of part i. Returns the
    request; wait before reading ``out``. Under gloo the parts go as messages, each rank's
    received into ``recv`` (``(size - 1) x out.numel()`` elements; allocated if None) and
    summed at the wait."""
    if not initialized() or group_size(group) == 1:
        if out.data_ptr() != t.data_ptr():
            out.copy_(t)
        return _Done()
    check_for_group(t, group, caller)
    check_for_group(out, group, caller, what="output")
    size, n = group_size(group), out.numel()
    if t.numel() != n * size:
        raise CommError(f"{caller or caller_name()}: reduce-scatter of {t.numel()} elements into parts of "
                        f"{n} over {size} ranks")
    pairwise = _pairwise(group)
    if pairwise is None:
        return dist.reduce_scatter_tensor(out, t, group=group, async_op=True)
    ranks, me = pairwise
    if recv is None or recv.numel() < (size - 1) * n:
        recv = t.new_empty((size - 1) * n)
    ops, parts = [], []
    for k in range(1, size):  # peers in the order me+1, me+2, ...: each pair lists its messages alike
        peer = (me + k) % size
        ops.append(dist.P2POp(dist.isend, t[peer * n:(peer + 1) * n], ranks[peer], group))
        src = (me - k) % size
        part = recv[(k - 1) * n:k * n]
        ops.append(dist.P2POp(dist.irecv, part, ranks[src], group))
        parts.append(part)

    def total() -> None:
        out.copy_(t[me * n:(me + 1) * n])
        for part in parts:
            out.add_(part)

    return _Pairwise(dist.batch_isend_irecv(ops), total)


def all_gather_async(out: torch.Tensor, t: torch.Tensor, group: Any, *, caller: str | None = None) -> Any:
    """Start gathering every rank's ``t`` into ``out`` (``group size`` parts in group rank
    order, the reverse of ``reduce_scatter_async``). Returns the request; wait before
    reading ``out``. Under gloo, point-to-point messages straight into ``out``'s parts."""
    if not initialized() or group_size(group) == 1:
        if out.data_ptr() != t.data_ptr():
            out.copy_(t)
        return _Done()
    check_for_group(t, group, caller)
    check_for_group(out, group, caller, what="output")
    size, n = group_size(group), t.numel()
    if out.numel() != n * size:
        raise CommError(f"{caller or caller_name()}: all-gather of parts of {n} elements into "
                        f"{out.numel()} over {size} ranks")
    pairwise = _pairwise(group)
    if pairwise is None:
        return dist.all_gather_into_tensor(out, t, group=group, async_op=True)
    ranks, me = pairwise
    out[me * n:(me + 1) * n].copy_(t)
    ops = []
    for k in range(1, size):
        peer, src = (me + k) % size, (me - k) % size
        ops.append(dist.P2POp(dist.isend, t, ranks[peer], group))
        ops.append(dist.P2POp(dist.irecv, out[src * n:(src + 1) * n], ranks[src], group))
    return _Pairwise(dist.batch_isend_irecv(ops))


def broadcast_(t: torch.Tensor, src: int, group: Any, *, caller: str | None = None) -> torch.Tensor:
    """Overwrite ``t`` on every rank of ``group`` with ``src``'s (a global rank); returns ``t``."""
    if not initialized():
        return t
    check_for_group(t, group, caller)
    if group_size(group) > 1:
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        if ranks is not None and src not in ranks:
            raise CommError(f"{caller or caller_name()}: broadcast from rank {src}, which is not in the group {ranks}")
        dist.broadcast(t, src=src, group=group)
    return t


def barrier(group: Any = None, *, timeout_s: float | None = None, caller: str | None = None) -> None:
    """Wait until every rank of ``group`` arrives; with ``timeout_s``, raise ``TimeoutError``
    (naming the caller and the wait) if they do not all arrive in time.

    Under NCCL the barrier is a tiny collective on this rank's GPU that the CPU waits for
    (work of other groups or streams is not covered: ``parallel.destroy`` synchronises the
    device first).
    """
    size = group_size(group)
    if size == 1:
        return
    kwargs = {"device_ids": [torch.cuda.current_device()]} if "nccl" in group_backend(group) else {}
    work = dist.barrier(group=group, async_op=True, **kwargs)
    if timeout_s is None:
        work.wait()
        return
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{caller or caller_name()}: not every one of the {size} ranks reached the "
                               f"barrier within {timeout_s:g} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    work.wait()  # raises the backend's error if the barrier failed rather than finished


def all_gather(t: torch.Tensor, group: Any, *, caller: str | None = None) -> list[torch.Tensor]:
    """Every rank's ``t`` (the same shape and dtype on every rank), in group rank order."""
    if not initialized() or group_size(group) == 1:
        if initialized():
            check_for_group(t, group, caller)
        return [t]
    check_for_group(t, group, caller)
    out = [torch.empty_like(t) for _ in range(group_size(group))]
    dist.all_gather(out, t, group=group)
    return out


def all_gather_varlen(t: torch.Tensor, group: Any, *, caller: str | None = None) -> list[torch.Tensor]:
    """Every rank's ``t``, in group rank order, where shapes may differ between ranks (the
    number of dims and the dtype may not): sizes first, then the tensors padded to the
    largest. The parts returned are views into the gathered buffers."""
    if not initialized() or group_size(group) == 1:
        return all_gather(t, group, caller=caller)
    check_for_group(t, group, caller)
    if t.dim() > _MAX_DIMS:
        raise CommError(f"{caller or caller_name()}: all_gather_varlen takes up to {_MAX_DIMS} dims, "
                        f"got shape {tuple(t.shape)}")
    header = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64, device=t.device)
    header[0] = t.dim()
    header[1:1 + t.dim()] = torch.tensor(list(t.shape), dtype=torch.int64)
    headers = [h.tolist() for h in torch.stack(all_gather(header, group, caller=caller)).cpu()]
    dims = {h[0] for h in headers}
    if len(dims) > 1:  # every rank sees every header: they all raise together
        raise CommError(f"{caller or caller_name()}: all_gather_varlen of tensors with different numbers of "
                        f"dims over the group: {[h[0] for h in headers]}")
    shapes = [h[1:1 + t.dim()] for h in headers]
    biggest = [max(s[d] for s in shapes) for d in range(t.dim())]
    if list(t.shape) == biggest:
        padded = t
    else:
        padded = t.new_zeros(biggest)
        padded[tuple(slice(0, n) for n in t.shape)] = t
    parts = all_gather(padded, group, caller=caller)
    return [p[tuple(slice(0, n) for n in s)] for p, s in zip(parts, shapes)]


def all_gather_bytes(data: bytes, group: Any, *, caller: str | None = None) -> list[bytes]:
    """Every rank's ``data``, in group rank order: raw bytes, never a pickle."""
    if not initialized() or group_size(group) == 1:
        return [bytes(data)]
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    parts = all_gather_varlen(t.to(group_device(group)), group, caller=caller or caller_name())
    return [p.cpu().numpy().tobytes() for p in parts]


def exchange(sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]], *,
             group: Any = None, caller: str | None = None) -> None:
    """Send each ``(peer, tensor)`` of ``sends`` and receive into each ``(peer, buffer)`` of
    ``recvs`` (peers are global ranks) in one batched call, and wait for all of them.

    Rules that keep this safe under NCCL as under gloo: every rank that a message names
    must call ``exchange`` (its matching batch) in the same order of calls; two ranks that
    exchange several messages in one call list them in the same order on both sides (the
    halo exchange sends one message per peer and direction); no rank sends to itself.
    Under NCCL the batch is one group call (``ncclGroupStart``/``End``), so the order of
    sends and receives inside it cannot deadlock, even when the previous and next
    neighbours are the same rank (a periodic line of two). The first operation on a group
    must involve all its ranks (NCCL's rule for batched point-to-point): ``parallel.init``
    runs a barrier over the world under NCCL before any layer exchanges halos.
    """
    if not sends and not recvs:
        return
    me = dist.get_rank() if initialized() else 0
    ops = []
    for kind, items, fn in (("send", sends, dist.isend), ("receive buffer", recvs, dist.irecv)):
        for peer, t in items:
            if peer == me:
                raise CommError(f"{caller or caller_name()}: a {kind} to/from this rank itself ({me})")
            check_for_group(t, group, caller, what=f"{kind} for rank {peer}")
            ops.append(dist.P2POp(fn, t, peer, group))
    with region(HALO):  # named in traces, timed into the step's breakdown (parallel.comm.timing)
        for request in dist.batch_isend_irecv(ops):
            request.wait()
