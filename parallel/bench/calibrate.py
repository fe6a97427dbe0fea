"""Measure this machine for ``parallel.plan``: conv throughput per layer shape, element-wise
bandwidth, each layer's local time (alone, and while every rank computes at once),
point-to-point and all-reduce latency and bandwidth, the framework's overheads and the
fixed memory of a rank (``parallel.bench.network``). One thread per rank, as the training
runs; on CUDA one GPU per rank over NCCL, timers synchronised with the device.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parallel.bench import device as dev
from parallel.runtime import memory
from parallel.bench.layer_times import CPU, Case, best, busy_times, case_seconds
from parallel.bench.network import fit, network
from parallel.bench.ranks import run_ranks
from parallel.bench.shared import Rows, sizes
from parallel.bench.timing import load
from parallel.layers.conv.kernels import conv3d
from parallel.plan import Layer, first_layer
from parallel.job.family import get, names


def conv_throughput(shapes: Sequence[tuple[int, int, int, tuple[int, int, int], bool]],
                    trials: int = 3, device: torch.device = CPU) -> dict[str, Any]:
    """Forward+backward flop/s of ``Conv3d(cin, cout, k, padding=k//2)`` on a (1, cin, *size)
    block, as the spatial conv runs it (``parallel.layers.conv.conv3d``); without the input
    gradient where the last item is False (a model's first conv)."""
    out: dict[str, list[list[Any]]] = {}
    for cin, cout, k, size, input_grad in shapes:
        x = torch.randn(1, cin, *size, device=device, requires_grad=input_grad)
        conv = nn.Conv3d(cin, cout, k, padding=k // 2).to(device)
        g = torch.randn(1, cout, *size, device=device)

        def step() -> None:
            x.grad = None
            conv.zero_grad(set_to_none=True)
            conv3d(x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, 1).backward(g)

        secs = best(step, trials, device)
        voxels = size[0] * size[1] * size[2]
        flops = (3 if input_grad else 2) * 2 * cin * cout * k**3 * voxels
        out.setdefault(f"{cin}-{cout}-{k}", []).append([voxels, flops / secs, list(size)])
    return out


def elementwise_bandwidth(trials: int = 3, device: torch.device = CPU) -> float:
    """Bytes/s of LeakyReLU + MaxPool(2), forward and backward, counted as the model does."""
    x = torch.randn(1, 32, 32, 64, 64, device=device, requires_grad=True)

    def step() -> None:
        x.grad = None
        y = F.max_pool3d(F.leaky_relu(x, 0.3), 2)
        y.backward(torch.ones_like(y))

    secs = best(step, trials, device)
    nbytes = x.numel() * 4
    return 3.0 * (2 * nbytes + nbytes + nbytes / 8) / secs   # act: in+out, pool: in+out


def layer_overhead(trials: int = 5, device: torch.device = CPU) -> float:
    """Seconds per layer of a tiny conv stack (forward + backward): the fixed cost of a layer."""
    model = nn.Sequential(*[nn.Conv3d(1, 1, 1) for _ in range(20)]).to(device)
    x = torch.randn(1, 1, 2, 2, 2, device=device, requires_grad=True)
    return best(lambda: model(x).sum().backward(), trials, device) / 20


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
        secs = best(lambda: ds.load(0), 3)
        nbytes = ds.load(0)[1]
        ds.close()
    return nbytes / secs


def _conv_shapes(layers: list[Layer]) -> list[tuple[int, int, int, tuple[int, int, int], bool]]:
    """Each conv shape at the serial block and the 2-way blocks along D and W: oneDNN's speed
    depends on the block's shape (a conv split along W ran 4x faster than along D once)."""
    shapes, seen = [], set()
    for i, layer in enumerate(layers):
        key = (layer.in_shape[0], layer.out_shape[0], layer.kernel[0]) if layer.kind == "conv" else None
        if key is None or key in seen:
            continue
        seen.add(key)
        for axis, parts in ((0, 1), (0, 2), (2, 2)):
            size = list(layer.out_shape[1:])
            size[axis] = max(1, size[axis] // parts)
            shapes.append((*key, tuple(size), not first_layer(layers, i)))
    return shapes


def calibrate(cases: Sequence[Case], trials: int = 3, device: torch.device = CPU, busy_ranks: int = 2
              ) -> dict[str, Any]:
    """Everything ``parallel.plan.Machine`` holds, measured here (``cases``: the layer times)."""
    from parallel.plan import Machine

    torch.set_num_threads(1)
    layers = [l for c in {(c.family, c.size, c.overrides): c for c in cases}.values() for l in c.layers()]
    flops = conv_throughput(_conv_shapes(layers), max(trials, 5), device)
    sizes_ = [1024, 256 * 1024, 4 * 2**20]
    result: dict[str, Any] = {}
    if device.type == "cpu" or torch.cuda.device_count() >= 2:
        net = run_ranks(2, network, sizes_, trials, spatial=(2, 1, 1), device=device.type)[0]
        p_alpha, p_beta = fit(sizes_, net["p2p"])
        a_alpha, a_beta = fit(sizes_, net["allreduce"])
        a_alpha /= 2  # two ranks: the ring's 2 (P - 1) alpha + 2 (P - 1) / P bytes / beta is 2 alpha + bytes / beta
        result.update(p2p_alpha=p_alpha, p2p_beta=p_beta, ar_alpha=a_alpha, ar_beta=a_beta,
                      spatial_layer_overhead=net["spatial_layer_overhead"], overlap_overhead=net["overlap_overhead"],
                      baseline_memory=float(net["baseline_memory"]))
    else:  # one GPU: no network to measure; its figures stay the generic GPU's (said in "network")
        g = Machine.generic_machine("gpu")
        result.update(p2p_alpha=g.p2p_alpha, p2p_beta=g.p2p_beta, ar_alpha=g.ar_alpha, ar_beta=g.ar_beta,
                      spatial_layer_overhead=g.spatial_layer_overhead, overlap_overhead=g.overlap_overhead,
                      baseline_memory=memory.in_use_bytes(device), network="generic-gpu (one GPU: not measured)")
    alone = case_seconds(cases, trials, {}, device)
    busy = busy_times(cases, trials, {}, device, busy_ranks)
    common = [k for k in busy if k in alone and alone[k] > 0]
    return {
        "source": "measured", "device": device.type, "measured_at": dev.describe(device),
        "conv_flops": flops,
        "default_conv_flops": statistics.median(p[1] for pts in flops.values() for p in pts) if flops else 2e10,
        "mem_bandwidth": elementwise_bandwidth(trials, device),
        **result,
        "layer_overhead": layer_overhead(device=device),
        "io_bandwidth": io_bandwidth(),
        "layer_seconds": alone, "layer_seconds_busy": busy, "busy_ranks": busy_ranks if busy else 1,
        "busy_factor": statistics.median(busy[k] / alone[k] for k in common) if common else 1.0,
    }


def ensure_layer_seconds(path: Path, cases: Sequence[Case], busy_ranks: int = 2) -> int:
    """Measure the layer times ``cases`` need that the calibration file at ``path`` lacks
    (alone, and busy for busy cases), and add them to it; the number of times measured."""
    import json

    data = json.loads(path.read_text(encoding="utf-8"))
    device = torch.device(data.get("device", "cpu"))
    alone, busy = dict(data.get("layer_seconds", {})), dict(data.get("layer_seconds_busy", {}))
    before = len(alone) + len(busy)
    torch.set_num_threads(1)
    alone = case_seconds(cases, 3, alone, device)
    busy = busy_times(cases, 3, busy, device, busy_ranks)
    added = len(alone) + len(busy) - before
    if added:
        data["layer_seconds"], data["layer_seconds_busy"] = alone, busy
        if busy:
            data["busy_ranks"] = busy_ranks
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        tmp.replace(path)
    return added


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
    p.add_argument("--busy-ranks", type=int, default=2,
                   help="processes computing at once for the busy layer times (the ranks of a node; 1: none)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per rank, NCCL with 2 GPUs or more)")


def command(args: argparse.Namespace) -> Rows:
    """Measure this machine for parallel.plan (conv throughput per shape, network, overheads)."""
    import json

    from parallel.plan import default_calibration

    device = dev.parse(args.device)
    cases = []
    for name in names():
        over = tuple(args.set if name == args.model else get(name).bench_overrides)
        for g in (g for g in args.layer_splits.split(",") if g):
            for b in args.layer_batches.split(","):
                spatial = tuple(sizes(g))
                # Serial at the larger batch runs alone; split and data-parallel ranks share the node.
                busy = spatial != (1, 1, 1) or int(b) == min(int(v) for v in args.layer_batches.split(","))
                cases.append(Case(name, (args.size,) * 3, over, spatial, int(b), busy))  # type: ignore[arg-type]
    result = calibrate(cases, device=device, busy_ranks=args.busy_ranks)
    path = Path(args.calibration) if args.calibration else default_calibration()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1), encoding="utf-8")
    yield {"kind": "calibration", "path": str(path), **result, "load": load()}
