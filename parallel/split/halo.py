"""Halo exchange along one tensor dim, as an autograd function with an exact adjoint.

A layer asks for a *window* ``[lo, hi)`` of the global dim: the part of the input its
output block needs. The window may reach into neighbouring blocks (a halo), stop short
of its own block's ends (a trim, at strided layers on uneven splits), or leave the
volume (filled with a constant, or wrapped around for periodic boxes). Every rank knows
every rank's window, so each can work out what to send and what to expect without
asking: one batched isend/irecv per peer.

The backward is the adjoint: gradients of the halo travel back to their owners and are
added there. The same plan run the other way (``reduce``) sums overlapping partial
outputs into their owners, which is what a transposed convolution needs.

``fetch_all``/``reduce_all`` run several dims' plans in a row without autograd, and
``in_background`` starts such a chain (a helper thread on CPUs, a side stream on GPUs),
so a layer can compute what needs no halo while the messages travel
(``parallel.layers.conv.shell``, which exchanges only the halo shell: ``parallel.split.shell``).

Messages go through ``parallel.comm.exchange``: one batched call per dim, one message
per peer and direction, every request waited for.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import torch

from parallel import comm
from parallel.comm.timing import HALO, mark_background_thread, overlapped, region
from parallel.partition import block_bounds, window_segments
from parallel.split import layout
from parallel.split.nested import tensors as _tensors


@dataclass(frozen=True)
class ExchangePlan:
    """What this rank copies, sends, receives and fills along one dim.

    Lengths and offsets are along the dim; ``in_len`` is the length of the tensor the
    rank owns, ``out_len`` that of its window.
    """

    in_len: int
    out_len: int
    copies: tuple[tuple[int, int, int], ...]                      # (src, dst, length)
    fills: tuple[tuple[int, int], ...]                            # (dst, length)
    recvs: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]    # (peer, ((dst, length), ...))
    sends: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]    # (peer, ((src, length), ...))

    @property
    def is_local(self) -> bool:
        return not self.recvs and not self.sends

    @property
    def is_identity(self) -> bool:
        """The window is the block itself: nothing to copy, send or fill."""
        return (self.is_local and not self.fills and self.out_len == self.in_len
                and self.copies == ((0, 0, self.in_len),))


def make_plan(
    n: int,
    line: Sequence[int],
    position: int,
    windows: Sequence[tuple[int, int]],
    mode: Literal["constant", "circular"] = "constant",
) -> ExchangePlan:
    """Plan the exchange for the rank at ``position`` of ``line`` (global ranks).

    ``n`` is the global size of the dim whose blocks the ranks own, ``windows[j]`` the
    global ``[lo, hi)`` that position ``j`` wants.
    """
    parts = len(line)
    bounds = block_bounds(n, parts)
    copies, fills, recvs = [], [], {}
    lo, hi = windows[position]
    for seg in window_segments(lo, hi, n, parts, mode):
        if seg.owner is None:
            fills.append((seg.dst, seg.length))
        elif seg.owner == position:
            copies.append((seg.src, seg.dst, seg.length))
        else:
            recvs.setdefault(line[seg.owner], []).append((seg.dst, seg.length))
    sends = {}
    for j, (lo_j, hi_j) in enumerate(windows):
        if j == position:
            continue
        for seg in window_segments(lo_j, hi_j, n, parts, mode):
            if seg.owner == position:
                sends.setdefault(line[j], []).append((seg.src, seg.length))
    start, stop = bounds[position]
    return ExchangePlan(
        in_len=stop - start,
        out_len=hi - lo,
        copies=tuple(copies),
        fills=tuple(fills),
        recvs=tuple((p, tuple(s)) for p, s in sorted(recvs.items())),
        sends=tuple((p, tuple(s)) for p, s in sorted(sends.items())),
    )


def _resized(x: torch.Tensor, dim: int, length: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = length
    return shape


def _communicate(x: torch.Tensor, dim: int,
                 outgoing: Sequence[tuple[int, Sequence[tuple[int, int]]]],
                 incoming: Sequence[tuple[int, Sequence[tuple[int, int]]]]) -> list[tuple[torch.Tensor, Sequence[tuple[int, int]]]]:
    """Send the ``(start, length)`` pieces of ``x`` to each outgoing peer (one message
    per peer) and receive one message per incoming peer; returns the received buffers.

    One message per peer and direction, in one batched call that every rank of the line
    makes (each computes the same plans), all waited for: see ``comm.exchange`` for why
    this order is safe under NCCL, periodic lines of two included.
    """
    sends, received = [], []
    for peer, pieces in outgoing:
        sends.append((peer, torch.cat([x.narrow(dim, s, n) for s, n in pieces], dim=dim).contiguous()))
    for peer, pieces in incoming:
        received.append((x.new_empty(_resized(x, dim, sum(n for _, n in pieces))), pieces))
    comm.exchange(sends, [(peer, buf) for (peer, _), (buf, _) in zip(incoming, received)])
    return received


def _fetch(x: torch.Tensor, dim: int, plan: ExchangePlan, fill: float) -> torch.Tensor:
    if x.shape[dim] != plan.in_len:
        raise RuntimeError(f"halo exchange expected a block of {plan.in_len} along dim {dim}, got {x.shape[dim]}")
    y = layout.empty(_resized(x, dim, plan.out_len), x)  # the block's layout (NCDHW or channels-last)
    for dst, n in plan.fills:
        y.narrow(dim, dst, n).fill_(fill)
    for src, dst, n in plan.copies:
        y.narrow(dim, dst, n).copy_(x.narrow(dim, src, n))
    for buf, pieces in _communicate(x, dim, plan.sends, plan.recvs):
        offset = 0
        for dst, n in pieces:
            y.narrow(dim, dst, n).copy_(buf.narrow(dim, offset, n))
            offset += n
    return y


def _reduce(y: torch.Tensor, dim: int, plan: ExchangePlan) -> torch.Tensor:
    """The adjoint of ``_fetch``: window values are summed into their owners."""
    if y.shape[dim] != plan.out_len:
        raise RuntimeError(f"halo reduction expected a window of {plan.out_len} along dim {dim}, got {y.shape[dim]}")
    x = layout.zeros(_resized(y, dim, plan.in_len), y)
    for src, dst, n in plan.copies:
        x.narrow(dim, src, n).add_(y.narrow(dim, dst, n))
    for buf, pieces in _communicate(y, dim, plan.recvs, plan.sends):
        offset = 0
        for src, n in pieces:
            x.narrow(dim, src, n).add_(buf.narrow(dim, offset, n))
            offset += n
    return x


def _reduce_in_place(y: torch.Tensor, dim: int, plan: ExchangePlan) -> torch.Tensor | None:
    """``_reduce`` where the window holds the whole block in one piece: the block's rows of
    ``y`` themselves (a view, no zeroed copy), the halos received added into them, as
    LBANN DistConv does. Only for a ``y`` nobody else reads (it is written); None where the
    plan has another shape (a trimmed block, a local wrap)."""
    if len(plan.copies) != 1 or plan.copies[0][0] != 0 or plan.copies[0][2] != plan.in_len:
        return None
    if y.shape[dim] != plan.out_len:
        raise RuntimeError(f"halo reduction expected a window of {plan.out_len} along dim {dim}, got {y.shape[dim]}")
    x = y.narrow(dim, plan.copies[0][1], plan.in_len)
    for buf, pieces in _communicate(y, dim, plan.recvs, plan.sends):  # the halos leave before the adds
        offset = 0
        for src, n in pieces:
            x.narrow(dim, src, n).add_(buf.narrow(dim, offset, n))
            offset += n
    return x


class _Fetch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, plan: ExchangePlan, fill: float,
                own_grad: bool = False) -> torch.Tensor:
        ctx.dim, ctx.plan, ctx.own_grad = dim, plan, own_grad
        return _fetch(x, dim, plan, fill)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        grad = layout.dense(grad)
        gx = _reduce_in_place(grad, ctx.dim, ctx.plan) if ctx.own_grad else None
        return (_reduce(grad, ctx.dim, ctx.plan) if gx is None else gx), None, None, None, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, dim: int, plan: ExchangePlan) -> torch.Tensor:
        ctx.dim, ctx.plan = dim, plan
        return _reduce(y, dim, plan)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _fetch(layout.dense(grad), ctx.dim, ctx.plan, 0.0), None, None


def fetch(x: torch.Tensor, dim: int, plan: ExchangePlan, fill: float = 0.0, own_grad: bool = False) -> torch.Tensor:
    """This rank's window along ``dim``: its block plus halos (or trimmed), padded with
    ``fill`` outside the volume. Differentiable; the backward is the exact adjoint.
    ``own_grad``: the window's gradient reaches this backward from one consumer only (a
    convolution's), so the backward may write into it and return the block's rows of it."""
    if plan.is_identity and x.shape[dim] == plan.in_len:
        return x  # an aligned pooling window: no copy of the block
    return _Fetch.apply(x, dim, plan, fill, own_grad)


def reduce(y: torch.Tensor, dim: int, plan: ExchangePlan) -> torch.Tensor:
    """Sum every rank's window values into the owners' blocks (the adjoint of ``fetch``;
    out-of-volume values are dropped). Differentiable; the backward is ``fetch``."""
    return _Reduce.apply(y, dim, plan)


def fetch_all(x: torch.Tensor, steps: Sequence[tuple[int, ExchangePlan]], fill: float = 0.0) -> torch.Tensor:
    """``_fetch`` along each ``(dim, plan)`` in order, without autograd (corners come along)."""
    with torch.no_grad():
        for dim, plan in steps:
            x = _fetch(x, dim, plan, fill)
    return x


def reduce_all(y: torch.Tensor, steps: Sequence[tuple[int, ExchangePlan]]) -> torch.Tensor:
    """The adjoint of ``fetch_all``: ``_reduce`` along the same dims in reverse order."""
    with torch.no_grad():
        for dim, plan in reversed(steps):
            y = _reduce(layout.dense(y), dim, plan)
    return y


_executor: ThreadPoolExecutor | None = None
_side_streams: dict[int, Any] = {}  # one communication stream per GPU, made on first use


def _forget_executor() -> None:  # a forked child (a DataLoader worker) has no helper thread
    global _executor
    _executor = None


os.register_at_fork(after_in_child=_forget_executor)


class _Waited:
    """A background chain whose ``result()`` wait is a halo-exchange region (``parallel.comm.timing``):
    the part of the exchange the computation meanwhile did not hide."""

    def __init__(self, pending: Any) -> None:
        self.pending = pending

    def result(self) -> Any:
        with region(HALO, "parallel.halo_exchange_wait"):
            return self.pending.result()


def _start_halo_thread(threads: int) -> None:
    torch.set_num_threads(threads)
    mark_background_thread()  # its exchanges overlap the step: the step counts its wait for them


class _Done:
    """A chain that already ran (devices other than the CPU and CUDA)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self) -> Any:
        return self.value


class _OnSideStream:
    """A chain queued on a CUDA side stream; ``result`` makes the caller's stream wait for it."""

    def __init__(self, value: Any, side: Any, main: Any) -> None:
        self.value, self.side, self.main = value, side, main

    def result(self) -> Any:
        self.main.wait_stream(self.side)
        # Made on the side stream, used on the caller's: their memory must not be reused
        # before the caller's stream is done with it.
        for t in _tensors(self.value):
            t.record_stream(self.main)
        return self.value


def in_background(fn: Callable[..., Any], *args: Any) -> Any:
    """Start ``fn(*args)`` (an exchange chain such as ``fetch_all``) so that the caller can
    compute meanwhile; returns an object whose ``result()`` waits for it.

    CPU tensors (gloo): on the halo thread (one per process, so exchanges keep their
    order; gloo's calls block the thread that makes them). CUDA tensors (NCCL): on this
    thread, queued on a dedicated CUDA stream that first waits for the caller's stream:
    NCCL's calls do not block the CPU, so no thread is needed, and the packing and
    unpacking copies and the messages run beside the caller's kernels instead of behind
    them on one stream; ``result()`` makes the caller's stream wait and records the
    window for it (``record_stream``). Other devices run the chain at once.

    The caller must wait for the result before it starts any other exchange: messages
    between two ranks are matched in the order they are posted.
    """
    x = _tensors(args)[0]
    if x.device.type == "cuda":
        main = torch.cuda.current_stream(x.device)
        side = _side_streams.get(x.device.index)
        if side is None:
            side = _side_streams[x.device.index] = torch.cuda.Stream(x.device)
        side.wait_stream(main)  # the inputs are complete on the caller's stream
        with torch.cuda.stream(side), overlapped():  # the step counts its wait for the result, not this
            value = fn(*args)
        for a in _tensors(args):  # made on the caller's stream, read on the side stream
            a.record_stream(side)
        return _Waited(_OnSideStream(value, side, main))
    if x.device.type != "cpu":
        return _Done(fn(*args))
    global _executor
    if _executor is None:
        threads = torch.get_num_threads()
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="halo",
                                       initializer=_start_halo_thread, initargs=(threads,))
    return _Waited(_executor.submit(fn, *args))
