"""Measure this machine for ``parallel.plan``: conv throughput per layer shape, element-wise
bandwidth, point-to-point and all-reduce latency and bandwidth, per-layer overhead and the
fixed memory of a rank. One thread per rank, as the training runs."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from parallel import comm
import torch.nn.functional as F
from torch import nn

import parallel
from parallel.bench.ranks import run_ranks
from parallel.bench.shared import Rows, sizes
from parallel.bench.timing import load
from parallel.grid import Grid
from parallel.layers.kernels import conv3d
from parallel.plan import Layer, LocalOp, first_layer, local_ops, op_key
from parallel.train.family import get, names


def _trials(fn: Callable[[], None], trials: int) -> list[float]:
    """Seconds of ``trials`` calls of ``fn`` after a warm-up call."""
    fn()
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _best(fn: Callable[[], None], trials: int) -> float:
    return min(_trials(fn, trials))  # the least disturbed trial: other processes only ever add time


def _median(fn: Callable[[], None], trials: int) -> float:
    """A layer timed once or twice alone was seen to come out 30% fast or slow (the
    allocator's and the clock's state): the median of its trials."""
    return statistics.median(_trials(fn, trials))


def conv_throughput(shapes: Sequence[tuple[int, int, int, tuple[int, int, int], bool]],
                    trials: int = 3) -> dict[str, float]:
    """Forward+backward flop/s of ``Conv3d(cin, cout, k, padding=k//2)`` on a (1, cin, *size)
    block, as the spatial conv runs it (``parallel.layers.conv.conv3d``); without the input
    gradient where the last item is False (a model's first conv)."""
    out: dict[str, list[list[float]]] = {}
    for cin, cout, k, size, input_grad in shapes:
        x = torch.randn(1, cin, *size, requires_grad=input_grad)
        conv = nn.Conv3d(cin, cout, k, padding=k // 2)
        g = torch.randn(1, cout, *size)

        def step() -> None:
            x.grad = None
            conv.zero_grad(set_to_none=True)
            conv3d(x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, 1).backward(g)

        secs = _best(step, trials)
        voxels = size[0] * size[1] * size[2]
        flops = (3 if input_grad else 2) * 2 * cin * cout * k**3 * voxels
        out.setdefault(f"{cin}-{cout}-{k}", []).append([voxels, flops / secs, list(size)])
    return out


def elementwise_bandwidth(trials: int = 3) -> float:
    """Bytes/s of LeakyReLU + MaxPool(2), forward and backward, counted as the model does."""
    x = torch.randn(1, 32, 32, 64, 64, requires_grad=True)

    def step() -> None:
        x.grad = None
        y = F.max_pool3d(F.leaky_relu(x, 0.3), 2)
        y.backward(torch.ones_like(y))

    secs = _best(step, trials)
    nbytes = x.numel() * 4
    return 3.0 * (2 * nbytes + nbytes + nbytes / 8) / secs   # act: in+out, pool: in+out


def layer_overhead(trials: int = 5) -> float:
    """Seconds per layer of a tiny conv stack (forward + backward): the fixed cost of a layer."""
    model = nn.Sequential(*[nn.Conv3d(1, 1, 1) for _ in range(20)])
    x = torch.randn(1, 1, 2, 2, 2, requires_grad=True)
    return _best(lambda: model(x).sum().backward(), trials) / 20


def _materialize(module: nn.Module) -> nn.Module:
    """A CPU copy of a (meta-device) layer with fresh parameters."""
    import copy

    m = copy.deepcopy(module).to_empty(device="cpu")
    if getattr(m, "inplace", False):  # the timed input is a leaf; out of place costs about the same
        m.inplace = False
    if hasattr(m, "reset_parameters"):
        m.reset_parameters()
    elif hasattr(m, "reset_running_stats"):
        m.reset_running_stats()
    return m.train()


def _shell_call(m: nn.Conv3d, op: LocalOp) -> Callable[[torch.Tensor], torch.Tensor]:
    """A split conv's local arithmetic (``parallel.layers.shellconv``): the block convolved
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
            piece = torch.randn(shape)
            cpads = list(pads)
            cpads[a] = 0
            part = conv3d(piece, m.weight.narrow(a + 2, 0, taps), None, m.stride, cpads, m.dilation, m.groups)
            y = _AddRows.apply(y, part, a + 2)
        return y
    return run


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


def _local_call(layer: Layer, op: LocalOp, batch: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    """The computation a rank runs for ``layer`` on its block (no communication), and its
    input: a split conv convolves its block and adds the halo pieces' parts; a split norm
    takes the framework's two-pass statistics; the rest run the torch layer."""
    m = _materialize(layer.module)  # type: ignore[arg-type]
    shape = [batch, *op.in_local]
    if isinstance(m, nn.Conv3d) and any(op.split):
        return _shell_call(m, op), torch.randn(shape)
    if isinstance(m, (nn.BatchNorm3d, nn.InstanceNorm3d, nn.GroupNorm)) and any(op.split):
        from parallel.layers import norm
        from parallel.layers.base import convert
        from parallel.layers.shapes import ShapeTracker

        one = Grid(spatial=(1, 1, 1), world_size=1, rank=0)
        cls = {nn.BatchNorm3d: norm.SpatialBatchNorm3d, nn.InstanceNorm3d: norm.SpatialInstanceNorm3d,
               nn.GroupNorm: norm.SpatialGroupNorm}[type(m)]
        return convert(m, cls, one, ShapeTracker(one), layer.name), torch.randn(shape)
    if op.flat_split:  # the Linear's slice for this block (the framework reshapes a weight slice)
        assert isinstance(m, nn.Linear)
        n = op.in_local[0]
        return (lambda x: F.linear(x, m.weight[:, :n].reshape(m.out_features, n), m.bias)), torch.randn(shape)
    return m, torch.randn(shape)


def layer_seconds(layers: list[Layer], cases: Sequence[tuple[Sequence[int], int]], trials: int = 3,
                  known: dict[str, float] | None = None) -> dict[str, float]:
    """Forward+backward seconds of each layer's local computation for each (spatial split,
    local batch) in ``cases``, keyed by ``parallel.plan.op_key``; keys in ``known`` are kept."""
    out: dict[str, float] = dict(known or {})
    for spatial, batch in cases:
        for layer, op in zip(layers, local_ops(layers, spatial)):
            key = op_key(layer, op, batch)
            if key in out or layer.module is None:
                continue
            fn, x = _local_call(layer, op, batch)
            x.requires_grad_(op.input_grad)
            params = [p for p in (fn.parameters() if isinstance(fn, nn.Module) else ()) if p.requires_grad]
            grad = torch.randn_like(fn(x)) if x.requires_grad or params or layer.params else None

            def step() -> None:
                x.grad = None
                y = fn(x)
                if grad is not None and y.requires_grad:
                    y.backward(grad)

            out[key] = _median(step, trials)
    return out


def _network(grid: Grid, sizes: Sequence[int], trials: int) -> dict[str, Any]:
    rank = grid.rank
    peer = 1 - rank
    from parallel.bench.step import resident_bytes

    res: dict[str, Any] = {"baseline_memory": resident_bytes()}  # not the peak: inherited across exec
    p2p, ar = [], []
    for n in sizes:
        buf = torch.zeros(n // 4)
        times = []
        for _ in range(trials + 1):
            comm.barrier(caller="calibrate: p2p")
            t0 = time.perf_counter()
            for _ in range(4):  # ping-pong: 8 one-way messages
                for sender in (0, 1):
                    if rank == sender:
                        comm.exchange([(peer, buf)], [], caller="calibrate: p2p")
                    else:
                        comm.exchange([], [(peer, buf)], caller="calibrate: p2p")
            times.append((time.perf_counter() - t0) / 8)
        p2p.append(statistics.median(times[1:]))
        times = []
        for _ in range(trials + 1):
            comm.barrier(caller="calibrate: all-reduce")
            t0 = time.perf_counter()
            for _ in range(4):
                comm.all_reduce_(buf, None, caller="calibrate: all-reduce")
            times.append((time.perf_counter() - t0) / 4)
        ar.append(statistics.median(times[1:]))
    res["p2p"], res["allreduce"] = p2p, ar

    # The framework's extra cost per split layer (halo messages have their own term): a stack
    # of tiny pointwise convs split 2 ways vs local.
    model = nn.Sequential(*[nn.Conv3d(1, 1, 1) for _ in range(20)])
    pmodel = parallel.parallelize(model, grid)
    if pmodel.sync is not None:  # the gradient all-reduce has its own term in the model
        pmodel.sync.remove()
        pmodel.sync = None
    x = parallel.scatter(torch.randn(1, 1, 4, 2, 2), grid).requires_grad_(True)
    plain = nn.Sequential(*[nn.Conv3d(1, 1, 1) for _ in range(20)])

    def split() -> None:
        pmodel(x).sum().backward()

    def local() -> None:
        plain(x).sum().backward()

    res["spatial_layer_overhead"] = max(0.0, (_best(split, trials) - _best(local, trials)) / 20)
    return res


def _fit(sizes: Sequence[int], times: Sequence[float]) -> tuple[float, float]:
    """alpha, beta from the smallest and largest message."""
    (n0, t0), (n1, t1) = (sizes[0], times[0]), (sizes[-1], times[-1])
    beta = (n1 - n0) / max(t1 - t0, 1e-9)
    alpha = max(t0 - n0 / beta, 1e-7)
    return alpha, beta


def io_bandwidth(size: int = 64) -> float:
    """Bytes/s of reading one uncompressed synthetic sample (of the default family) through
    the block reader."""
    import tempfile

    from parallel.bench.reads import synthetic_samples, write_files
    from parallel.data import BlockDataset

    with tempfile.TemporaryDirectory() as tmp:
        family = get(names()[0])
        f = write_files(Path(tmp), family.spec, synthetic_samples(family, 1, size), [(1, 1, 1)], "none")[0]
        ds = BlockDataset([f])
        secs = _best(lambda: ds.load(0), 3)
        nbytes = ds.load(0)[1]
        ds.close()
    return nbytes / secs


def calibrate(layers: list[Layer], trials: int = 3,
              cases: Sequence[tuple[list[Layer], Sequence[int], int]] = ()) -> dict[str, Any]:
    """Everything ``parallel.plan.Machine`` holds, measured here; ``cases`` (layers, spatial
    split, local batch) also get each layer's local time measured."""
    torch.set_num_threads(1)
    shapes = []
    seen = set()
    for i, layer in enumerate(layers):
        if layer.kind != "conv":
            continue
        key = (layer.in_shape[0], layer.out_shape[0], layer.kernel[0])
        if key in seen:
            continue
        seen.add(key)
        # The serial block and the 2-way blocks along D and W: oneDNN's speed depends on the
        # block's shape (a conv split along W can run 4x faster than the same split along D).
        for axis, parts in ((0, 1), (0, 2), (2, 2)):
            size = list(layer.out_shape[1:])
            size[axis] = max(1, size[axis] // parts)
            shapes.append((*key, tuple(size), not first_layer(layers, i)))
    flops = conv_throughput(shapes, max(trials, 5))
    sizes = [1024, 4 * 2**20]
    net = run_ranks(2, _network, sizes, trials, spatial=(2, 1, 1))[0]
    p_alpha, p_beta = _fit(sizes, net["p2p"])
    a_alpha, a_beta = _fit(sizes, net["allreduce"])
    a_alpha /= 2  # two ranks: the ring's 2 (P - 1) alpha + 2 (P - 1) / P bytes / beta is 2 alpha + bytes / beta
    timed: dict[str, float] = {}
    for case_layers, spatial, batch in cases:
        timed = layer_seconds(case_layers, [(spatial, batch)], known=timed)
    return {
        "conv_flops": flops,
        "default_conv_flops": statistics.median(p[1] for pts in flops.values() for p in pts) if flops else 2e10,
        "mem_bandwidth": elementwise_bandwidth(trials),
        "p2p_alpha": p_alpha, "p2p_beta": p_beta, "ar_alpha": a_alpha, "ar_beta": a_beta,
        "layer_overhead": layer_overhead(),
        "spatial_layer_overhead": net["spatial_layer_overhead"],
        "io_bandwidth": io_bandwidth(),
        "baseline_memory": float(net["baseline_memory"]),
        "layer_seconds": timed,
    }


def ensure_layer_seconds(path: Path, cases: Sequence[tuple[list[Layer], Sequence[int], int]]) -> int:
    """Measure the layer times ``cases`` need that the calibration file at ``path`` lacks, and
    add them to it; the number of layers measured."""
    import json

    data = json.loads(path.read_text(encoding="utf-8"))
    timed = dict(data.get("layer_seconds", {}))
    before = len(timed)
    torch.set_num_threads(1)
    for case_layers, spatial, batch in cases:
        timed = layer_seconds(case_layers, [(spatial, batch)], known=timed)
    if len(timed) > before:
        data["layer_seconds"] = timed
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        tmp.replace(path)
    return len(timed) - before


# -- the subcommand ----------------------------------------------------------------------

def command_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=names()[0], help="the family --set applies to (the others: their "
                                                       "benchmark models)")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--set", nargs="*", default=[])
    p.add_argument("--calibration", default=None, help="where to write (default: parallel.plan's file)")
    p.add_argument("--layer-splits", default="1x1x1,2x1x1,1x1x2",
                   help="spatial splits whose per-layer local times to measure ('' for none)")
    p.add_argument("--layer-batches", default="1,2", help="local batches whose per-layer times to measure")


def command(args: argparse.Namespace) -> Rows:
    """Measure this machine for parallel.plan (conv throughput per shape, network, overheads)."""
    import json

    from parallel.plan import build_model, default_calibration, trace

    layers, cases = [], []
    for name in names():
        over = args.set if name == args.model else list(get(name).bench_overrides)
        model, in_shape, _ = build_model(name, (args.size,) * 3, over)
        traced = trace(model, in_shape)
        layers += traced
        cases += [(traced, sizes(g), int(b)) for g in args.layer_splits.split(",") if g
                  for b in args.layer_batches.split(",")]
    result = calibrate(layers, cases=cases)
    path = Path(args.calibration) if args.calibration else default_calibration()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1), encoding="utf-8")
    yield {"kind": "calibration", "path": str(path), **result, "load": load()}
