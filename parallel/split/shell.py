"""The halo shell: the part of a layer's window outside the rank's own block, exchanged
without ever forming the window.

``parallel.split.halo.fetch`` returns the whole window (block plus halos), a copy of the block
the size of the layer's input. A convolution only needs the halos themselves: it can
convolve the block in place and add what the halos contribute (``parallel.layers.conv.shell``).
This module runs the same exchange plans as ``parallel.split.halo``, dim after dim, but keeps
the window as an *onion*: the block (the core) and, for each exchanged dim in chain order,
a thin left and right piece. The piece of step ``j`` spans the window along the dims
exchanged before it (so corners arrive through the chain, as in ``halo.fetch_all``) and
the block along the dims exchanged after it; the pieces are disjoint and, with the core,
tile the window.

``assemble`` builds any box of the window from the onion (with the core or with zeros in
its place), ``scatter_grad`` is its adjoint, and ``fetch_shell``/``reduce_shell`` are the
exchange and its exact adjoint (gradients of the pieces go back to their owners, and come
out as additions into the block's gradient). Messages go through ``parallel.comm.exchange``,
one batched call per dim, in the order of ``parallel.split.halo``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from parallel import comm
from parallel.split.halo import ExchangePlan

Ranges = dict[int, tuple[int, int]]   # tensor dim -> (start, length); dims not named: whole
Shell = list[tuple[torch.Tensor, torch.Tensor]]   # (left, right) piece per step
Additions = list[tuple[tuple[slice, ...], torch.Tensor]]  # (index into the block, gradient to add)


@dataclass(frozen=True)
class ShellStep:
    """One exchanged dim: its plan and where the block's own rows (the core) sit in the window."""

    dim: int
    plan: ExchangePlan
    core_dst: int      # window rows before the core: the left piece's length
    core_src: int      # first block row of the core (> 0 where the window trims the block)
    core_len: int
    left_fill: bool    # the left piece is only constant fill (zeros): nothing to add, nothing to send back
    right_fill: bool

    @property
    def right_len(self) -> int:
        return self.plan.out_len - self.core_dst - self.core_len

    def parts(self) -> tuple[tuple[int, int, str], ...]:
        """(start, length, kind) of the left piece, the core and the right piece along ``dim``."""
        return ((0, self.core_dst, "L"), (self.core_dst, self.core_len, "C"),
                (self.core_dst + self.core_len, self.right_len, "R"))


def shell_step(dim: int, plan: ExchangePlan, window: tuple[int, int], block: tuple[int, int]) -> ShellStep | None:
    """The onion step for ``plan`` (the window ``[lo, hi)`` of a rank owning ``block`` of the
    global dim), or None where the plan does not copy the block's overlap with the window
    in one piece (then the caller fetches the whole window)."""
    (lo, hi), (b0, b1) = window, block
    c0, c1 = max(lo, b0), min(hi, b1)
    if c1 <= c0:
        return None
    core = (c0 - b0, c0 - lo, c1 - c0)   # (src, dst, length), as in ExchangePlan.copies
    if core not in plan.copies:
        return None
    dst = core[1]
    written = [(d, n) for s, d, n in plan.copies if (s, d, n) != core]
    written += [p for _, pieces in plan.recvs for p in pieces]
    left_fill = not any(d < dst for d, _ in written)
    right_fill = not any(d >= dst + core[2] for d, _ in written)
    return ShellStep(dim, plan, dst, core[0], core[2], left_fill, right_fill)


def extent(shape: Sequence[int], steps: Sequence[ShellStep], level: int) -> list[int]:
    """The shape of the onion after ``level`` steps (the block's, windowed along their dims)."""
    out = list(shape)
    for st in steps[:level]:
        out[st.dim] = st.plan.out_len
    return out


def index(ranges: Ranges, ndim: int) -> tuple[slice, ...]:
    idx = [slice(None)] * ndim
    for d, (s, n) in ranges.items():
        idx[d] = slice(s, s + n)
    return tuple(idx)


def assemble(x: torch.Tensor, shell: Shell, steps: Sequence[ShellStep], level: int, ranges: Ranges,
             zero_core: bool) -> torch.Tensor:
    """The box ``ranges`` (in the coordinates of the onion after ``level`` steps) of the
    window, from the block ``x`` and the pieces; with zeros in place of the block where
    ``zero_core``. A view where the box lies in one piece, else a concatenation."""
    if level == 0:
        part = x[index(ranges, x.dim())]
        return x.new_zeros(part.shape) if zero_core else part
    st = steps[level - 1]
    s, n = ranges.get(st.dim, (0, st.plan.out_len))
    parts = []
    for p0, plen, kind in st.parts():
        a, b = max(s, p0), min(s + n, p0 + plen)
        if b <= a:
            continue
        sub = dict(ranges)
        if kind == "C":
            sub[st.dim] = (a - p0 + st.core_src, b - a)
            parts.append(assemble(x, shell, steps, level - 1, sub, zero_core))
        else:
            sub[st.dim] = (a - p0, b - a)
            piece = shell[level - 1][0 if kind == "L" else 1]
            parts.append(piece[index(sub, piece.dim())])
    return parts[0] if len(parts) == 1 else torch.cat(parts, st.dim)


def scatter_grad(g: torch.Tensor, gshell: Shell, steps: Sequence[ShellStep], level: int, ranges: Ranges,
                 adds: Additions | None) -> None:
    """The adjoint of ``assemble(..., zero_core=adds is None)``: ``g`` (the gradient of the
    box) is added into the pieces' gradients; the block's part is appended to ``adds``
    (dropped when None: a zero core is no function of the block)."""
    if level == 0:
        if adds is not None:
            adds.append((index(ranges, g.dim()), g))
        return
    st = steps[level - 1]
    s, n = ranges.get(st.dim, (0, st.plan.out_len))
    for p0, plen, kind in st.parts():
        a, b = max(s, p0), min(s + n, p0 + plen)
        if b <= a:
            continue
        part = g.narrow(st.dim, a - s, b - a)
        sub = dict(ranges)
        if kind == "C":
            sub[st.dim] = (a - p0 + st.core_src, b - a)
            scatter_grad(part, gshell, steps, level - 1, sub, adds)
        else:
            sub[st.dim] = (a - p0, b - a)
            piece = gshell[level - 1][0 if kind == "L" else 1]
            piece[index(sub, piece.dim())] += part


def _piece_view(left: torch.Tensor, right: torch.Tensor, st: ShellStep, dst: int, n: int) -> torch.Tensor:
    """Window rows ``[dst, dst + n)`` along the step's dim, in the piece that holds them."""
    if dst + n <= st.core_dst:
        return left.narrow(st.dim, dst, n)
    start = dst - st.core_dst - st.core_len
    if start < 0:
        raise RuntimeError(f"halo shell: window rows [{dst}, {dst + n}) of dim {st.dim} overlap the block's own rows")
    return right.narrow(st.dim, start, n)


def _whole_piece(left: torch.Tensor, right: torch.Tensor, st: ShellStep,
                 pieces: Sequence[tuple[int, int]]) -> torch.Tensor | None:
    """The piece that a message of ``pieces`` fills entirely, if one does."""
    if len(pieces) != 1:
        return None
    dst, n = pieces[0]
    if dst == 0 and n == st.core_dst:
        return left
    if dst == st.core_dst + st.core_len and n == st.right_len:
        return right
    return None


def fetch_shell(x: torch.Tensor, steps: Sequence[ShellStep], fill: float = 0.0) -> Shell:
    """The onion's pieces of this rank's window (``halo.fetch_all`` without the block's copy).
    No autograd: the layer that calls it supplies the backward (``reduce_shell``)."""
    shell: Shell = []
    with torch.no_grad():
        for i, st in enumerate(steps):
            d, plan = st.dim, st.plan
            if x.shape[d] != plan.in_len:
                raise RuntimeError(f"halo shell expected a block of {plan.in_len} along dim {d}, got {x.shape[d]}")
            shape = extent(x.shape, steps, i)
            left = x.new_empty([*shape[:d], st.core_dst, *shape[d + 1:]])
            right = x.new_empty([*shape[:d], st.right_len, *shape[d + 1:]])
            for dst, n in plan.fills:
                _piece_view(left, right, st, dst, n).fill_(fill)
            for src, dst, n in plan.copies:
                if (src, dst, n) != (st.core_src, st.core_dst, st.core_len):  # a local wrap (circular)
                    _piece_view(left, right, st, dst, n).copy_(assemble(x, shell, steps, i, {d: (src, n)}, False))
            sends = [(peer, torch.cat([assemble(x, shell, steps, i, {d: (s, n)}, False) for s, n in pieces], d)
                      .contiguous()) for peer, pieces in plan.sends]
            recvs = []
            for peer, pieces in plan.recvs:
                whole = _whole_piece(left, right, st, pieces)  # one message filling a piece: received in place
                buf = whole if whole is not None else x.new_empty([*shape[:d], sum(n for _, n in pieces), *shape[d + 1:]])
                recvs.append((peer, buf, pieces, whole is not None))
            comm.exchange(sends, [(peer, buf) for peer, buf, _, _ in recvs], caller="parallel.split.shell.fetch_shell")
            for _, buf, pieces, direct in recvs:
                offset = 0
                for dst, n in pieces:
                    if not direct:
                        _piece_view(left, right, st, dst, n).copy_(buf.narrow(d, offset, n))
                    offset += n
            shell.append((left, right))
    return shell


def reduce_shell(gshell: Shell, steps: Sequence[ShellStep], shape: Sequence[int]) -> Additions:
    """The adjoint of ``fetch_shell``: the pieces' gradients (``gshell``, complete, updated in
    place as lower steps receive theirs) go back to their owners, last step first; returns
    what to add into this rank's block gradient (shape ``shape``)."""
    adds: Additions = []
    with torch.no_grad():
        for i in reversed(range(len(steps))):
            st = steps[i]
            d, plan = st.dim, st.plan
            gl, gr = gshell[i]
            for src, dst, n in plan.copies:
                if (src, dst, n) != (st.core_src, st.core_dst, st.core_len):
                    scatter_grad(_piece_view(gl, gr, st, dst, n), gshell, steps, i, {d: (src, n)}, adds)
            sends = [(peer, torch.cat([_piece_view(gl, gr, st, dst, n) for dst, n in pieces], d).contiguous())
                     for peer, pieces in plan.recvs]
            ext = extent(shape, steps, i)
            recvs = [(peer, gl.new_empty([*ext[:d], sum(n for _, n in pieces), *ext[d + 1:]]), pieces)
                     for peer, pieces in plan.sends]
            comm.exchange(sends, [(peer, buf) for peer, buf, _ in recvs], caller="parallel.split.shell.reduce_shell")
            for _, buf, pieces in recvs:
                offset = 0
                for src, n in pieces:
                    scatter_grad(buf.narrow(d, offset, n), gshell, steps, i, {d: (src, n)}, adds)
                    offset += n
    return adds
