"""Layer times for ``parallel.plan``: each layer's local computation (what a rank runs for it
on its block, no communication) timed forward and backward, alone (``case_seconds``) and
while every rank of a node computes at once (``busy_times``). ``parallel.bench.calibrate``
stores them in the machine's calibration.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parallel.bench import device as dev
from parallel.bench.ranks import run_ranks
from parallel.bench.timing import barrier_trials
from parallel.grid import Grid
from parallel.layers.conv.kernels import conv3d
from parallel.plan import Layer, LocalOp, local_ops, op_key

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Case:
    """Layer times to measure: a family's model on ``size`` at ``spatial``, local ``batch``;
    ``busy`` also times them while every rank of a node computes at once."""

    family: str
    size: tuple[int, int, int]
    overrides: tuple[str, ...]
    spatial: tuple[int, int, int]
    batch: int
    busy: bool = False

    def layers(self) -> list[Layer]:
        from parallel.plan import build_model, trace

        model, in_shape, _ = build_model(self.family, self.size, list(self.overrides))
        return trace(model, in_shape)


def _trials(fn: Callable[[], None], trials: int, device: torch.device = CPU) -> list[float]:
    """Seconds of ``trials`` calls of ``fn`` after a warm-up call (synchronised timers)."""
    fn()
    return [dev.seconds(fn, device) for _ in range(trials)]


def best(fn: Callable[[], None], trials: int, device: torch.device = CPU) -> float:
    return min(_trials(fn, trials, device))  # the least disturbed trial: other processes only ever add time


def _median(fn: Callable[[], None], trials: int, device: torch.device = CPU) -> float:
    """A layer timed once or twice alone was seen to come out 30% fast or slow (the
    allocator's and the clock's state): the median of its trials."""
    return statistics.median(_trials(fn, trials, device))


def _together(fn: Callable[[], None], trials: int, device: torch.device, group: Any, slowest: bool = True) -> float:
    """Median over trials of the slowest rank's seconds (``slowest``: a split layer, whose
    exchanges make every rank wait for the last) or of the ranks' mean (a whole layer of a
    data-parallel step, where nothing waits until the gradient all-reduce: a sum of
    per-layer maxima would add every layer's jitter), every trial started by a barrier."""
    return statistics.median(barrier_trials(fn, trials, device, group, "max" if slowest else "mean",
                                            caller="calibrate: busy layers"))


def _materialize(module: nn.Module, device: torch.device = CPU) -> nn.Module:
    """A copy of a (meta-device) layer with fresh parameters on ``device``."""
    m = copy.deepcopy(module).to_empty(device=device)
    if getattr(m, "inplace", False):  # the timed input is a leaf; out of place costs about the same
        m.inplace = False
    if hasattr(m, "reset_parameters"):
        m.reset_parameters()
    elif hasattr(m, "reset_running_stats"):
        m.reset_running_stats()
    return m.train()


class _AddRows(torch.autograd.Function):
    """``y[first rows along dim] += part`` in place, as the shell convolution adds a piece."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, part: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.dim, ctx.rows = dim, part.shape[dim]
        y.narrow(dim, 0, part.shape[dim]).add_(part)
        ctx.mark_dirty(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, grad.narrow(ctx.dim, 0, ctx.rows), None


def _shell_call(m: nn.Conv3d, op: LocalOp) -> Callable[[torch.Tensor], torch.Tensor]:
    """A split conv's local arithmetic (``parallel.layers.conv.shell``): the block convolved
    zero-padded, plus one halo piece per split dim (the lower ranks' one neighbour) through
    the taps that reach it, added into the rows it feeds."""
    pads = tuple(m.padding) if not isinstance(m.padding, str) else tuple(
        m.dilation[a] * (m.kernel_size[a] - 1) // 2 for a in range(3))

    def run(x: torch.Tensor) -> torch.Tensor:
        y = conv3d(x, m.weight, m.bias, m.stride, pads, m.dilation, m.groups)
        for a in range(3):
            h = pads[a]
            if not op.split[a] or h == 0:
                continue
            taps = min(m.kernel_size[a], -(-h // m.dilation[a]))
            rows = -(-h // m.stride[a])
            shape = list(x.shape)
            shape[a + 2] = (rows - 1) * m.stride[a] + (taps - 1) * m.dilation[a] + 1
            cpads = list(pads)
            cpads[a] = 0
            part = conv3d(torch.randn(shape, device=x.device), m.weight.narrow(a + 2, 0, taps), None, m.stride,
                          cpads, m.dilation, m.groups)
            y = _AddRows.apply(y, part, a + 2)
        return y
    return run


def _local_call(layer: Layer, op: LocalOp, batch: int, device: torch.device = CPU
                ) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    """The computation a rank runs for ``layer`` on its block (no communication), and its
    input: a split conv convolves its block and adds the halo pieces' parts; a split norm
    takes the framework's two-pass statistics; a Flatten+Linear multiplies by its columns
    (sharded by block: a contiguous weight); the rest run the torch layer."""
    m = _materialize(layer.module, device)  # type: ignore[arg-type]
    x = torch.randn([batch, *op.in_local], device=device)
    if isinstance(m, nn.Conv3d) and any(op.split):
        return _shell_call(m, op), x
    if isinstance(m, (nn.BatchNorm3d, nn.InstanceNorm3d, nn.GroupNorm)) and any(op.split):
        from parallel.layers import norm
        from parallel.layers.base import convert
        from parallel.layers.shapes import ShapeTracker

        one = Grid(spatial=(1, 1, 1), world_size=1, rank=0, device=device)
        cls = {nn.BatchNorm3d: norm.SpatialBatchNorm3d, nn.InstanceNorm3d: norm.SpatialInstanceNorm3d,
               nn.GroupNorm: norm.SpatialGroupNorm}[type(m)]
        return convert(m, cls, one, ShapeTracker(one), layer.name), x
    if op.flat_split:
        assert isinstance(m, nn.Linear)
        shard = nn.Parameter(m.weight.detach()[:, :op.in_local[0]].contiguous())
        return (lambda t: F.linear(t, shard, m.bias)), x
    return m, x


def layer_seconds(layers: list[Layer], cases: Sequence[tuple[Sequence[int], int]], trials: int = 3,
                  known: dict[str, float] | None = None, device: torch.device = CPU,
                  group: Any = None) -> dict[str, float]:
    """Forward+backward seconds of each layer's local computation for each (spatial split,
    local batch) in ``cases``, keyed by ``parallel.plan.op_key``; keys in ``known`` are kept.
    With ``group``, every rank of it times the same layers at once (the slowest counts)."""
    out: dict[str, float] = dict(known or {})
    for spatial, batch in cases:
        for layer, op in zip(layers, local_ops(layers, spatial)):
            key = op_key(layer, op, batch)
            if key in out or layer.module is None:
                continue
            fn, x = _local_call(layer, op, batch, device)
            x.requires_grad_(op.input_grad)
            params = [p for p in (fn.parameters() if isinstance(fn, nn.Module) else ()) if p.requires_grad]
            grad = torch.randn_like(fn(x)) if x.requires_grad or params or layer.params else None

            def step() -> None:
                x.grad = None
                y = fn(x)
                if grad is not None and y.requires_grad:
                    y.backward(grad)

            out[key] = _median(step, trials, device) if group is None else \
                _together(step, trials, device, group, slowest=any(op.split))
    return out


def case_seconds(cases: Sequence[Case], trials: int, known: dict[str, float], device: torch.device = CPU,
                 group: Any = None) -> dict[str, float]:
    """``layer_seconds`` of every case (each family's model traced once per size)."""
    out = dict(known)
    traced: dict[tuple, list[Layer]] = {}
    for c in cases:
        key = (c.family, c.size, c.overrides)
        if key not in traced:
            traced[key] = c.layers()
        out = layer_seconds(traced[key], [(c.spatial, c.batch)], trials, out, device, group)
    return out


def busy_times(cases: Sequence[Case], trials: int, known: dict[str, float], device: torch.device,
               ranks: int) -> dict[str, float]:
    """The busy cases' layer times with ``ranks`` processes computing at once (CPU only: on
    GPUs each rank has its own device)."""
    busy = [c for c in cases if c.busy]
    if ranks < 2 or not busy or device.type != "cpu":
        return dict(known)
    return run_ranks(ranks, busy_layer_seconds, busy, trials, known)[0]


def busy_layer_seconds(grid: Grid, cases: Sequence[Any], trials: int, known: dict[str, float]) -> dict[str, float]:
    """Every rank times the same layers at once (each trial started by a barrier; a trial's
    time is the slowest rank's): layer times as a node's ranks see them when they all
    compute. ``cases`` are ``Case``; keys in ``known`` are kept."""
    torch.set_num_threads(1)
    return case_seconds(cases, trials, known, grid.device, group=grid.world_group)
