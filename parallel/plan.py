"""Choose the (data x spatial) split: an alpha-beta-gamma model of one training step.

In the spirit of LBANN's performance model for spatial parallelism: each layer's compute
is its flops on the rank's block over a measured throughput (gamma, per conv shape, from
``python scripts/benchmark.py calibrate``); each halo exchange, the Flatten+Linear
all-reduce and the gradient all-reduce cost ``alpha + bytes / beta`` per message (ring
all-reduce: ``2 (P-1) alpha + 2 (P-1)/P bytes / beta``); the halo is hidden behind the
interior when the overlap is on. Memory per rank is the runtime's fixed baseline,
weights, gradients and optimiser state, and the activations kept for the backward (only
block inputs and one block's internals under recomputation). Bytes read per rank are
the sample's stored bytes over the spatial size, times the local batch.

    python -m parallel.plan --model cosmoflow --size 512 --devices 64 --device-memory 80GB \\
        --set model.n_conv_blocks=7 --batch 64 --alpha 5e-6 --bandwidth 25e9 --compute-scale 100
    python -m parallel.plan --model cosmoflow --size 64 --devices 2 --batch 2   # this machine

``parallel.spatial=auto`` in a training config asks ``choose`` for the world size at hand
(``parallel.train.autosplit``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

DEFAULT_CALIBRATION = Path(os.environ.get("SPATIALCNN_CALIBRATION",
                                          Path(__file__).resolve().parents[1] / "runs" / "calibration.json"))


@dataclass
class Machine:
    """Measured (or given) figures of one rank and the network between ranks."""

    conv_flops: dict[str, Any] = field(default_factory=dict)
    """Conv forward+backward flop/s per shape key ``cin-cout-k`` (one rank): a number, or
    ``[[voxels, flop/s], ...]`` measured at several block sizes (interpolated in log voxels)."""
    default_conv_flops: float = 2.0e10
    """Conv flop/s for shapes not measured."""
    mem_bandwidth: float = 2.0e9
    """Bytes/s of element-wise and pooling layers (forward + backward traffic)."""
    p2p_alpha: float = 5.0e-5
    """Seconds per point-to-point message (latency)."""
    p2p_beta: float = 1.0e9
    """Point-to-point bytes/s."""
    ar_alpha: float = 1.0e-4
    """Seconds per all-reduce step."""
    ar_beta: float = 1.0e9
    """All-reduce bytes/s per link."""
    layer_overhead: float = 2.0e-4
    """Seconds of framework overhead per layer and step (Python, dispatch, bookkeeping)."""
    spatial_layer_overhead: float = 1.0e-3
    """Extra seconds per split layer and step (shape cache, plans, halo thread)."""
    io_bandwidth: float = 5.0e8
    """Bytes/s one rank reads from storage (and decodes)."""
    baseline_memory: float = 3.0e8
    """Bytes of a rank before the model: the runtime, torch, the process group."""
    layer_seconds: dict[str, float] = field(default_factory=dict)
    """Measured forward+backward seconds of one layer's local computation (no communication),
    keyed by ``op_key``: the layer, its block, the local batch and which dims are split.
    Where a layer's key is here it replaces the throughput estimate; elsewhere (other
    sizes, other machines) the per-shape throughputs extrapolate."""

    def flops(self, cin: int, cout: int, k: int, voxels: float | None = None,
              shape: Sequence[int] | None = None) -> float:
        """Measured throughput of this conv: at this block shape if measured (the library's
        kernels differ by shape, not only by size), else interpolated in the voxel count."""
        got = self.conv_flops.get(f"{cin}-{cout}-{k}", self.default_conv_flops)
        if isinstance(got, (int, float)):
            return float(got)
        if shape is not None:
            for pt in got:
                if len(pt) > 2 and list(pt[2]) == list(shape):
                    return float(pt[1])
        pts = sorted((float(p[0]), float(p[1])) for p in got)
        if voxels is None or len(pts) == 1 or voxels <= pts[0][0]:
            return pts[0][1] if voxels is not None and voxels <= pts[0][0] else pts[-1][1]
        if voxels >= pts[-1][0]:
            return pts[-1][1]
        for (v0, f0), (v1, f1) in zip(pts, pts[1:]):
            if v0 <= voxels <= v1:
                w = math.log(voxels / v0) / math.log(v1 / v0) if v1 > v0 else 0.0
                return f0 + w * (f1 - f0)
        return pts[-1][1]

    def scaled(self, factor: float) -> None:
        """Compute figures times ``factor`` (a faster device than the calibrated one)."""
        self.conv_flops = {k: (v * factor if isinstance(v, (int, float)) else [[p[0], p[1] * factor, *p[2:]] for p in v])
                           for k, v in self.conv_flops.items()}
        self.default_conv_flops *= factor
        self.mem_bandwidth *= factor
        self.layer_seconds = {k: v / factor for k, v in self.layer_seconds.items()}

    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> "Machine":
        """The calibration file ``path``; without one, the default file if it exists, else the
        defaults above (a missing file that was asked for by name is an error)."""
        p = Path(path) if path is not None else DEFAULT_CALIBRATION
        if not p.is_file():
            if path is not None:
                raise FileNotFoundError(f"calibration file {p} not found; write one with "
                                        "'python scripts/benchmark.py calibrate --calibration FILE'")
            return cls()
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ValueError(f"calibration file {p} is unreadable ({err}); measure it again with "
                             "'python scripts/benchmark.py calibrate'") from None
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class Layer:
    """One leaf layer of the serial model, per sample (shapes without the batch dim)."""

    kind: str          # conv, convT, pool, norm, linear, other
    name: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    params: int
    kernel: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    halo: tuple[int, ...] = ()   # input voxels beyond the block on each side, per dim (D, H, W)
    flops: float = 0.0           # forward multiply-adds x 2, per sample
    spec: str = ""               # the module's repr: its type and settings (the key of its timings)
    block: int = -1              # the activation-checkpointing block it belongs to (parallel.recompute)
    module: nn.Module | None = field(default=None, repr=False, compare=False)  # on the meta device


def trace(model: nn.Module, in_shape: Sequence[int]) -> list[Layer]:
    """The leaf layers of ``model`` with their per-sample shapes (a forward on the meta device)."""
    layers: list[Layer] = []
    hooks = []

    def hook(name: str):
        def record(m: nn.Module, inputs: tuple, output: Any) -> None:
            x = inputs[0]
            y = output if isinstance(output, torch.Tensor) else output[0]
            params = sum(p.numel() for p in m.parameters(recurse=False))
            kind, kernel, stride, halo, flops = "other", (), (), (), 0.0
            if isinstance(m, (nn.Conv3d, nn.ConvTranspose3d)):
                kind = "conv" if isinstance(m, nn.Conv3d) else "convT"
                kernel, stride = tuple(m.kernel_size), tuple(m.stride)
                reach = [d * (k - 1) for k, d in zip(m.kernel_size, m.dilation)]
                halo = tuple((r + 1) // 2 for r in reach) if kind == "conv" else (0, 0, 0)
                per_out = 2 * m.in_channels // m.groups * math.prod(m.kernel_size)
                flops = per_out * (y[0].numel() if kind == "conv" else x[0].numel() * m.out_channels)
            elif isinstance(m, (nn.MaxPool3d, nn.AvgPool3d)):
                kind = "pool"
                k = m.kernel_size if isinstance(m.kernel_size, tuple) else (m.kernel_size,) * 3
                kernel = tuple(k)
                s = m.stride if m.stride is not None else m.kernel_size
                stride = tuple(s) if isinstance(s, tuple) else (s,) * 3
            elif isinstance(m, (nn.BatchNorm3d, nn.InstanceNorm3d, nn.GroupNorm)):
                kind = "norm"
            elif isinstance(m, nn.Linear):
                kind = "linear"
                flops = 2.0 * m.in_features * m.out_features
            layers.append(Layer(kind, name, tuple(x.shape[1:]), tuple(y.shape[1:]), params,
                                kernel, stride, halo, float(flops), " ".join(repr(m).split()),
                                block_of.get(name, -1), m))
        return record

    from parallel.recompute import block_leaves

    block_of = {name: b for b, names in enumerate(block_leaves(model)) for name in names}
    for name, m in model.named_modules():
        if not list(m.children()):
            hooks.append(m.register_forward_hook(hook(name)))
    try:
        model = model.to("meta")
        with torch.no_grad():
            model(torch.zeros((1, *in_shape), device="meta"))
    finally:
        for h in hooks:
            h.remove()
    return layers


@dataclass
class Options:
    """What the step does besides the model: batch, precision of storage, switches."""

    global_batch: int = 1
    stored_bytes_per_voxel: float = 8.0   # all input channels of one voxel, as stored
    overlap: bool = False
    recompute: bool = False
    optimizer_states: int = 1             # momentum (SGD) 1, AdamW 2
    act_bytes: int = 4                    # fp32 activations


def first_layer(layers: list[Layer], i: int) -> bool:
    """Whether layer ``i`` reads the model input (no input gradient in the backward)."""
    return layers[i].in_shape == layers[0].in_shape and all(
        l.kind in ("other",) and l.in_shape == l.out_shape for l in layers[:i])


def _local(shape: Sequence[int], spatial: Sequence[int]) -> list[int]:
    """Largest block of a (C, D, H, W) tensor split ``spatial`` ways (lower ranks are larger)."""
    return [shape[0], *(math.ceil(n / s) for n, s in zip(shape[1:], spatial))]


def valid(layers: list[Layer], spatial: Sequence[int]) -> bool:
    """Every 5-D activation has at least one voxel per block along every split dim."""
    for layer in layers:
        for shape in (layer.in_shape, layer.out_shape):
            if len(shape) == 4 and any(n < s for n, s in zip(shape[1:], spatial)):
                return False
    return True


@dataclass
class LocalOp:
    """What one rank computes for one layer: its block in and out (per sample), which dims
    are split (a split conv reads a window: its block plus halos, unpadded along those
    dims), whether the backward needs the input gradient, and the timing key."""

    in_local: tuple[int, ...]
    out_local: tuple[int, ...]
    split: tuple[bool, ...]
    input_grad: bool
    flat_split: bool = False   # a Linear on the flattened distributed volume: partial products


def local_ops(layers: list[Layer], spatial: Sequence[int]) -> list[LocalOp]:
    """The rank's share of every layer for a spatial split (the largest block: lower ranks)."""
    ops = []
    flat_local: tuple[int, ...] | None = None
    for i, layer in enumerate(layers):
        five = len(layer.in_shape) == 4
        in_local = tuple(_local(layer.in_shape, spatial)) if five else tuple(layer.in_shape)
        out_local = tuple(_local(layer.out_shape, spatial)) if len(layer.out_shape) == 4 else tuple(layer.out_shape)
        split = tuple(p > 1 for p in spatial) if five else (False, False, False)
        flat = False
        if five and len(layer.out_shape) == 1:  # Flatten: the next Linear multiplies the block
            flat_local = (math.prod(in_local),) if any(split) else None
        elif layer.kind == "linear" and flat_local is not None:
            in_local, flat, flat_local = flat_local, True, None
        ops.append(LocalOp(in_local, out_local, split, not first_layer(layers, i), flat))
    return ops


def op_key(layer: Layer, op: LocalOp, batch: int) -> str:
    """The key of a layer's measured local time in ``Machine.layer_seconds``."""
    shape = "x".join(map(str, op.in_local))
    split = "".join("1" if s else "0" for s in op.split)
    return f"{layer.spec} | in {batch}x{shape} | split {split}{' flat' if op.flat_split else ''} | grad {int(op.input_grad)}"


def _peak_activations(kept: list[float], working: list[float], blocks: list[int], recompute: bool) -> float:
    """Peak bytes of activations and gradients over a step, besides the model input. The
    backward of layer ``i`` holds what layers ``0..i`` kept plus its two gradients (later
    layers' tensors are freed by then). Under recomputation, a block (``blocks[i]`` >= 0,
    as ``parallel.recompute`` cuts them) keeps only its output through the forward, and
    holds its recomputed internals while it is backpropagated."""
    n = len(kept)
    last = [i == n - 1 or blocks[i] < 0 or blocks[i + 1] != blocks[i] for i in range(n)]
    through = [k if not recompute or blocks[i] < 0 or last[i] else 0.0 for i, k in enumerate(kept)]
    peak = sum(through)
    before = 0.0      # kept through the forward by the layers before the current block/layer
    inner = 0.0       # the current block's recomputed internals so far
    for i in range(n):
        if recompute and blocks[i] >= 0:
            inner += kept[i]
            peak = max(peak, before + inner + working[i])
            if last[i]:
                before += through[i]
                inner = 0.0
        else:
            before += through[i]
            peak = max(peak, before + working[i])
    return peak


def predict(layers: list[Layer], machine: Machine, data: int, spatial: Sequence[int],
            opts: Options) -> dict[str, float]:
    """Predicted seconds per step, bytes of memory and bytes read per rank for one split."""
    s = math.prod(spatial)
    world = data * s
    batch = math.ceil(opts.global_batch / data)
    compute = comm = exposed = overhead = 0.0
    measured = 0
    kept: list[float] = []
    working: list[float] = []
    model_input = 0.0
    params = 0
    for i, (layer, op) in enumerate(zip(layers, local_ops(layers, spatial))):
        params += layer.params
        out_local, in_local = op.out_local, op.in_local
        frac = math.prod(out_local) / max(math.prod(layer.out_shape), 1)
        split_layer = s > 1 and any(op.split)
        out_bytes = math.prod(out_local) * opts.act_bytes * batch
        in_bytes = math.prod(in_local) * opts.act_bytes * batch
        # A measured time of this very computation wins; else flops / throughput, bytes / bandwidth.
        known = machine.layer_seconds.get(op_key(layer, op, batch))
        if known is not None:
            measured += 1
            compute += known
        overhead += (0.0 if known is not None else machine.layer_overhead) + \
            (machine.spatial_layer_overhead if split_layer else 0.0)
        if layer.kind in ("conv", "convT"):
            cin, cout = layer.in_shape[0], layer.out_shape[0]
            k = layer.kernel[0] if layer.kernel else 1
            passes = 3.0 if op.input_grad else 2.0   # fwd, weight grad, input grad
            voxels = math.prod(out_local[1:]) * batch
            t = passes * layer.flops * frac * batch / machine.flops(cin, cout, k, voxels, out_local[1:])
            if known is None:
                compute += t
            else:
                t = known
            if split_layer and layer.kind == "conv":
                halo_t = 0.0
                for a, parts in enumerate(spatial):
                    if parts > 1 and layer.halo[a] > 0:
                        face = in_bytes / in_local[a + 1] * layer.halo[a]
                        halo_t += 2 * (2 * machine.p2p_alpha + 2 * face / machine.p2p_beta)  # fwd + bwd
                comm += halo_t
                if opts.overlap:
                    interior = min(1.0, max(0.0, 1 - 2 * max(layer.halo) / max(min(in_local[1:]), 1)))
                    exposed += max(0.0, halo_t - t * interior)
                else:
                    exposed += halo_t
            elif split_layer:  # transposed conv: partial outputs summed into owners
                halo_t = 2 * (2 * machine.p2p_alpha + 2 * out_bytes / out_local[1] / machine.p2p_beta)
                comm += halo_t
                exposed += halo_t
        elif layer.kind == "linear":
            if known is None:
                share = in_local[0] / max(layer.in_shape[0], 1)
                compute += 3.0 * layer.flops * share * batch / machine.default_conv_flops
            if op.flat_split:  # Flatten+Linear partial products: all-reduce, forward and backward
                nbytes = layer.out_shape[0] * batch * opts.act_bytes
                t = 2 * (2 * (s - 1) * machine.ar_alpha + 2 * (s - 1) / s * nbytes / machine.ar_beta)
                comm += t
                exposed += t
        elif known is None:
            compute += 3.0 * (in_bytes + out_bytes) / machine.mem_bandwidth
        if layer.kind == "norm" and split_layer:  # statistics: two all-reduces forward, two backward
            nbytes = 8.0 * layer.in_shape[0] * batch
            t = 4 * (2 * (s - 1) * machine.ar_alpha + 2 * (s - 1) / s * nbytes / machine.ar_beta)
            comm += t
            exposed += t
        # Tensors kept for the backward: each layer's output (its successor saves it), a
        # split conv's window, max-pooling indices (int64), the model input; an in-place
        # layer makes none. During its backward a layer also holds two gradients.
        inplace = bool(getattr(layer.module, "inplace", False))
        saved = 0.0 if inplace else out_bytes
        if i == 0:
            model_input = in_bytes
        elif layer.in_shape != layers[i - 1].out_shape:  # built outside the leaf layers (a concatenation)
            saved += in_bytes
        if split_layer and layer.kind == "conv":
            saved += in_bytes
        if layer.spec.startswith("MaxPool"):
            saved += math.prod(out_local) * 8 * batch
        kept.append(saved)
        working.append(in_bytes + out_bytes)
    act = model_input + _peak_activations(kept, working, [l.block for l in layers], opts.recompute)
    if opts.recompute:
        compute *= 4.0 / 3.0  # one more forward
    grad_bytes = params * 4
    allreduce = 0.0
    if world > 1:
        allreduce = 2 * (world - 1) * machine.ar_alpha + 2 * (world - 1) / world * grad_bytes / machine.ar_beta
    # The optimiser reads weights, gradients and its states and writes weights and states.
    optimizer = params * 4 * (3 + 2 * opts.optimizer_states) / machine.mem_bandwidth
    step = compute + exposed + allreduce + overhead + optimizer
    memory = machine.baseline_memory + params * 4 * (2 + opts.optimizer_states) + act
    read = opts.stored_bytes_per_voxel * math.prod(layers[0].in_shape[1:]) / s * batch
    return {"step_s": step, "compute_s": compute, "halo_s": comm, "exposed_comm_s": exposed,
            "allreduce_s": allreduce, "overhead_s": overhead, "optimizer_s": optimizer, "memory_bytes": memory,
            "activation_bytes": act, "read_bytes": read, "io_s": read / machine.io_bandwidth,
            "measured_layers": measured / max(len(layers), 1)}


def splits(devices: int, layers: list[Layer], max_data: int | None = None) -> list[tuple[int, tuple[int, int, int]]]:
    """Every (data, (sd, sh, sw)) with data x sd x sh x sw = devices that the model allows."""
    out = []
    for d in range(1, devices + 1):
        if devices % d or (max_data is not None and d > max_data):
            continue
        s = devices // d
        for sd in range(1, s + 1):
            for sh in range(1, s // sd + 1):
                if s % (sd * sh):
                    continue
                sw = s // (sd * sh)
                if sd >= sh >= sw and valid(layers, (sd, sh, sw)):  # D first: contiguous slabs
                    out.append((d, (sd, sh, sw)))
    return out


def table(layers: list[Layer], machine: Machine, devices: int, memory_limit: float,
          opts: Options) -> list[dict[str, Any]]:
    """One row per split, fastest first; ``fits`` and ``best`` marked."""
    rows = []
    for d, sp in splits(devices, layers, max_data=opts.global_batch):
        p = predict(layers, machine, d, sp, opts)
        rows.append({"data": d, "spatial": list(sp), **p, "fits": p["memory_bytes"] <= memory_limit})
    rows.sort(key=lambda r: r["step_s"])
    for r in rows:
        r["best"] = False
    fitting = [r for r in rows if r["fits"]]
    if fitting:
        fitting[0]["best"] = True
    return rows


def choose(layers: list[Layer], machine: Machine, devices: int, memory_limit: float,
           opts: Options) -> tuple[int, int, int]:
    """The spatial split of the fastest row that fits (the smallest-memory row if none fits)."""
    rows = table(layers, machine, devices, memory_limit, opts)
    if not rows:
        raise ValueError(f"no (data x spatial) split of {devices} devices suits this model")
    best = next((r for r in rows if r["best"]), min(rows, key=lambda r: r["memory_bytes"]))
    return tuple(best["spatial"])  # type: ignore[return-value]


# -- models by name ------------------------------------------------------------------------

def build_model(name: str, size: Sequence[int], overrides: Sequence[str] = ()) -> tuple[nn.Module, tuple[int, ...], float]:
    """(model, per-sample input shape, stored bytes per voxel) for ``cosmoflow`` or ``unet3d``."""
    from omegaconf import OmegaConf

    model_over = OmegaConf.from_dotlist([o[len("model."):] for o in overrides if o.startswith("model.")])
    if name == "cosmoflow":
        from cosmoflow.model import CosmoFlow, CosmoFlowConfig

        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(CosmoFlowConfig), model_over))
        with torch.device("meta"):
            model = CosmoFlow(cfg, tuple(size))
        return model, (cfg.in_channels, *size), 2.0 * cfg.in_channels   # int16 counts
    if name == "unet3d":
        from unet3d.model import UNet3D, UNet3DConfig

        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(UNet3DConfig), model_over))
        with torch.device("meta"):
            model = UNet3D(cfg)
        return model, (cfg.in_channels, *size), 4.0 * cfg.in_channels + 1  # float32 image, uint8 label
    raise ValueError(f"unknown model {name!r}: cosmoflow or unet3d")


def parse_bytes(text: str) -> float:
    """``80GB``, ``512MiB``, ``1e9`` -> bytes."""
    t = text.strip().upper()
    for suffix, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("TB", 1e12), ("GB", 1e9),
                         ("MB", 1e6), ("KB", 1e3), ("B", 1)):
        if t.endswith(suffix):
            return float(t[: -len(suffix)]) * mult
    return float(t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="cosmoflow", choices=["cosmoflow", "unet3d"])
    p.add_argument("--size", type=int, nargs="+", default=[128], help="sample D H W (one number: a cube)")
    p.add_argument("--set", nargs="*", default=[], help="model overrides, e.g. model.n_conv_blocks=7")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--device-memory", default="inf", help="bytes per device, e.g. 80GB")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: devices)")
    p.add_argument("--calibration", default=None, help=f"JSON from calibrate (default {DEFAULT_CALIBRATION})")
    p.add_argument("--compute-scale", type=float, default=1.0, help="device flop/s over the calibrated rank's")
    p.add_argument("--alpha", type=float, default=None, help="network latency, seconds per message")
    p.add_argument("--bandwidth", type=float, default=None, help="network bytes/s per link")
    p.add_argument("--io-bandwidth", type=float, default=None, help="storage bytes/s per rank")
    p.add_argument("--overlap", action="store_true", help="halo exchanges hidden behind the interior")
    p.add_argument("--recompute", action="store_true", help="activation checkpointing per block")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    args = p.parse_args(argv)
    size = args.size * 3 if len(args.size) == 1 else args.size
    model, in_shape, stored = build_model(args.model, size, args.set)
    layers = trace(model, in_shape)
    try:
        m = Machine.load(args.calibration)
    except (OSError, ValueError) as err:
        print(f"parallel.plan: {err}", file=sys.stderr)
        return 2
    if args.compute_scale != 1.0:
        m.scaled(args.compute_scale)
    if args.alpha is not None:
        m.p2p_alpha = m.ar_alpha = args.alpha
    if args.bandwidth is not None:
        m.p2p_beta = m.ar_beta = args.bandwidth
    if args.io_bandwidth is not None:
        m.io_bandwidth = args.io_bandwidth
    opts = Options(global_batch=args.batch or args.devices, stored_bytes_per_voxel=stored,
                   overlap=args.overlap, recompute=args.recompute)
    rows = table(layers, m, args.devices, parse_bytes(args.device_memory), opts)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"{args.model} {'x'.join(map(str, size))}, {args.devices} devices, global batch {opts.global_batch}, "
          f"memory limit {args.device_memory} per device")
    print(f"{'data':>5} {'spatial':>9} {'step s':>9} {'compute':>9} {'comm':>8} {'mem/rank GiB':>13} "
          f"{'read/rank MiB':>14}  ")
    for r in rows:
        mark = "<- fastest that fits" if r["best"] else ("" if r["fits"] else "(does not fit)")
        print(f"{r['data']:>5} {'x'.join(map(str, r['spatial'])):>9} {r['step_s']:>9.3f} {r['compute_s']:>9.3f} "
              f"{r['exposed_comm_s'] + r['allreduce_s']:>8.3f} {r['memory_bytes'] / 2**30:>13.2f} "
              f"{r['read_bytes'] / 2**20:>14.1f}  {mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
