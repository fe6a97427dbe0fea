"""Measure this machine for ``parallel.plan``: conv throughput per layer shape, element-wise
bandwidth, point-to-point and all-reduce latency and bandwidth, per-layer overhead and the
fixed memory of a rank. One thread per rank, as the training runs."""

from __future__ import annotations

import resource
import statistics
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import parallel
from parallel.bench.ranks import run_ranks
from parallel.grid import Grid
from parallel.plan import Layer, first_layer


def _best(fn: Callable[[], None], trials: int) -> float:
    fn()
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)  # the least disturbed trial: other processes only ever add time


def conv_throughput(shapes: Sequence[tuple[int, int, int, tuple[int, int, int], bool]],
                    trials: int = 3) -> dict[str, float]:
    """Forward+backward flop/s of ``Conv3d(cin, cout, k, padding=k//2)`` on a (1, cin, *size)
    block; without the input gradient where the last item is False (a model's first conv)."""
    out: dict[str, list[list[float]]] = {}
    for cin, cout, k, size, input_grad in shapes:
        x = torch.randn(1, cin, *size, requires_grad=input_grad)
        conv = nn.Conv3d(cin, cout, k, padding=k // 2)
        g = torch.randn(1, cout, *size)

        def step() -> None:
            x.grad = None
            conv.zero_grad(set_to_none=True)
            conv(x).backward(g)

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


def _network(grid: Grid, sizes: Sequence[int], trials: int) -> dict[str, Any]:
    rank = grid.rank
    peer = 1 - rank
    res: dict[str, Any] = {"baseline_memory": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    p2p, ar = [], []
    for n in sizes:
        buf = torch.zeros(n // 4)
        times = []
        for _ in range(trials + 1):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(4):  # ping-pong: 8 one-way messages
                if rank == 0:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
            times.append((time.perf_counter() - t0) / 8)
        p2p.append(statistics.median(times[1:]))
        times = []
        for _ in range(trials + 1):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(4):
                dist.all_reduce(buf)
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
    """Bytes/s of reading one uncompressed synthetic CosmoFlow sample through the block reader."""
    import tempfile
    from pathlib import Path

    from cosmoflow import synthetic
    from cosmoflow.fields import SPEC
    from parallel.data import BlockDataset, write_samples

    with tempfile.TemporaryDirectory() as tmp:
        v, t = synthetic.sample(0, 0, 0, size)
        f = write_samples(Path(tmp) / "s.h5", SPEC, {"volume": v[None], "target": t[None]}, [(1, 1, 1)], "none")
        ds = BlockDataset([f])
        secs = _best(lambda: ds.load(0), 3)
        nbytes = ds.load(0)[1]
        ds.close()
    return nbytes / secs


def calibrate(layers: list[Layer], trials: int = 3) -> dict[str, Any]:
    """Everything ``parallel.plan.Machine`` holds, measured here."""
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
    return {
        "conv_flops": flops,
        "default_conv_flops": statistics.median(p[1] for pts in flops.values() for p in pts) if flops else 2e10,
        "mem_bandwidth": elementwise_bandwidth(trials),
        "p2p_alpha": p_alpha, "p2p_beta": p_beta, "ar_alpha": a_alpha, "ar_beta": a_beta,
        "layer_overhead": layer_overhead(),
        "spatial_layer_overhead": net["spatial_layer_overhead"],
        "io_bandwidth": io_bandwidth(),
        "baseline_memory": float(net["baseline_memory"]),
    }
