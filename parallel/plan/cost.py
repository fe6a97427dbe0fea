"""The cost model: predicted seconds per step, memory and bytes read per rank for one
(data x spatial) split, from the traced layers and a ``Machine``."""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from parallel.model.trace import Layer
from parallel.plan.local import LocalOp, local_ops, op_key
from parallel.plan.machine import Machine

log = logging.getLogger("parallel")


@dataclass
class Options:
    """What the step does besides the model: batch, precision of storage, switches."""

    global_batch: int = 1
    stored_bytes_per_voxel: float = 8.0   # all input channels of one voxel, as stored
    overlap: bool | str = False           # True, False or "auto" (per layer, as parallelize decides)
    recompute: bool = False
    optimizer_states: int = 1             # momentum (SGD) 1, AdamW 2
    act_bytes: int = 4                    # fp32 activations
    kfac: Any = None                      # a parallel.plan.kfac.KFACPlan: K-FAC's work and memory added
    shard_linear: bool = True             # Flatten+Linear weights sharded by block (as the loop runs them)
    node_ranks: int = 1                   # ranks sharing one machine's cores (CPU ranks of a node; 1 per GPU)
    voxel_loss_tensors: float = 7.0       # output-sized float tensors a voxel-wise loss holds at its peak (below)
    fs_bandwidth: float | None = None     # bytes/s of the shared file system, all ranks together (None: no limit)


def _voxel_loss_bytes(layers: list[Layer], out_local: tuple[int, ...], batch: int, opts: Options) -> float:
    """Bytes a voxel-wise loss holds at the start of the backward when the network's output
    is a volume (C, D, H, W): Dice + cross-entropy (``unet3d.losses``) keeps the softmax,
    the float one-hot labels and cross-entropy's log-softmax, and its backward adds the
    gradients of both branches and their sum (``voxel_loss_tensors`` output-sized tensors
    in all), besides the labels as int64. Measured on the U-Net's split ranks: 86 bytes a
    voxel at 128^3, 96 at 256^3, for 3 classes; this counts 92."""
    if len(layers[-1].out_shape) != 4 or len(out_local) != 4:
        return 0.0
    voxels = math.prod(out_local[1:]) * batch
    return voxels * (out_local[0] * 4 * opts.voxel_loss_tensors + 8)


def _peak_activations(kept: list[float], working: list[float], blocks: list[int], recompute: bool,
                      loss: float = 0.0) -> float:
    """Peak bytes of activations and gradients over a step, besides the model input. The
    backward of layer ``i`` holds what layers ``0..i`` kept plus its two gradients (later
    layers' tensors are freed by then). Under recomputation, a block (``blocks[i]`` >= 0,
    as ``parallel.model.recompute`` cuts them) keeps only its output through the forward, and
    holds its recomputed internals while it is backpropagated."""
    n = len(kept)
    last = [i == n - 1 or blocks[i] < 0 or blocks[i + 1] != blocks[i] for i in range(n)]
    through = [k if not recompute or blocks[i] < 0 or last[i] else 0.0 for i, k in enumerate(kept)]
    peak = sum(through) + loss  # the end of the forward: everything kept, and the loss's tensors
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


def _native_columns(layer: Layer, op: LocalOp, batch: int, machine: Machine) -> float:
    """Bytes of the column buffer torch's native CPU kernel builds for an unsplit float32 conv
    with N*C*D*H <= 20480 (``parallel.layers.conv.kernels``; split blocks are reordered to
    oneDNN instead): C_in x taps x output voxels, alive in the backward."""
    if machine.device != "cpu" or layer.kind != "conv" or any(op.split) or len(op.in_local) != 4:
        return 0.0
    taps = math.prod(layer.kernel) if layer.kernel else 1
    if taps == 1 or batch * op.in_local[0] * op.in_local[1] * op.in_local[2] > 20480:
        return 0.0
    return float(op.in_local[0] * taps * math.prod(op.out_local[1:]) * batch * 4)


def _exchange_seconds(layer: Layer, op: LocalOp, spatial: Sequence[int], machine: Machine,
                      bytes_per_voxel: float) -> float:
    """Seconds of a resampling, padding or adaptive pooling layer's exchanges, forward and
    backward: its halo faces along the split dims (a message each way), or for a global
    pool the partial results of the line (one value per channel from every other rank)."""
    t = 0.0
    for a, parts in enumerate(spatial):
        if parts == 1:
            continue
        if layer.kind == "gpool":
            nbytes = layer.in_shape[0] * bytes_per_voxel
            t += 2 * (parts - 1) * (machine.p2p_alpha + nbytes / machine.p2p_beta)
        elif layer.halo and layer.halo[a] > 0:
            face = math.prod(op.in_local) / op.in_local[a + 1] * layer.halo[a] * bytes_per_voxel
            t += 2 * (2 * machine.p2p_alpha + 2 * face / machine.p2p_beta)
    return t


def predict(layers: list[Layer], machine: Machine, data: int, spatial: Sequence[int],
            opts: Options) -> dict[str, float]:
    """Predicted seconds per step, bytes of memory and bytes read per rank for one split."""
    s = math.prod(spatial)
    world = data * s
    batch = math.ceil(opts.global_batch / data)
    busy = min(world, opts.node_ranks) > 1   # ranks computing at once share the cores and memory bandwidth
    slow = machine.busy_factor if busy else 1.0
    compute = comm = exposed = overhead = 0.0
    measured = 0
    kept: list[float] = []
    working: list[float] = []
    model_input = 0.0
    params = 0
    sharded = 0.0   # weight elements sharded by block (each rank holds 1/s of them)
    for i, (layer, op) in enumerate(zip(layers, local_ops(layers, spatial))):
        params += layer.params
        saved_shell = 0.0
        out_local, in_local = op.out_local, op.in_local
        frac = math.prod(out_local) / max(math.prod(layer.out_shape), 1)
        split_layer = s > 1 and any(op.split)
        out_bytes = math.prod(out_local) * opts.act_bytes * batch
        in_bytes = math.prod(in_local) * opts.act_bytes * batch
        # A measured time of this very computation wins; else flops / throughput, bytes / bandwidth.
        known = machine.layer_time(op_key(layer, op, batch), busy)
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
            t = passes * layer.flops * frac * batch / machine.flops(cin, cout, k, voxels, out_local[1:]) * slow
            if known is None:
                compute += t
            else:
                t = known
            if split_layer and layer.kind == "conv":
                # The block is convolved in place (its time above); each halo piece adds its rows
                # through the taps that reach it (parallel.layers.conv.shell), and only the shell
                # travels (kept for the backward too).
                halo_t = extra = 0.0
                for a, parts in enumerate(spatial):
                    if parts > 1 and layer.halo[a] > 0:
                        sides = 1 if parts == 2 else 2   # the largest block's rank has one neighbour when 2-way
                        face = in_bytes / in_local[a + 1] * layer.halo[a]
                        halo_t += 2 * (2 * machine.p2p_alpha + 2 * face / machine.p2p_beta)  # fwd + bwd
                        rows = math.ceil(layer.halo[a] / layer.stride[a]) / max(out_local[a + 1], 1)
                        extra += sides * rows * min(1.0, layer.halo[a] / max(layer.kernel[a], 1))
                        saved_shell += sides * face
                if known is None:  # a measured split conv (calibrate) includes its corrections
                    compute += t * extra
                comm += halo_t
                hidden = max(0.0, halo_t - t) + 2 * machine.overlap_overhead
                exposed += {True: hidden, False: halo_t}.get(opts.overlap, min(hidden, halo_t))  # type: ignore[call-overload]
            elif split_layer:  # transposed conv: partial outputs summed into owners
                halo_t = 2 * (2 * machine.p2p_alpha + 2 * out_bytes / out_local[1] / machine.p2p_beta)
                comm += halo_t
                exposed += halo_t
        elif layer.kind == "linear":
            if known is None:
                share = in_local[0] / max(layer.in_shape[0], 1)
                compute += 3.0 * layer.flops * share * batch / machine.default_conv_flops
            if op.flat_split and opts.shard_linear and s > 1:  # the weight's block columns per rank
                sharded += layer.in_shape[0] * layer.out_shape[0]
            if op.flat_split:  # Flatten+Linear partial products: all-reduce, forward and backward
                nbytes = layer.out_shape[0] * batch * opts.act_bytes
                t = 2 * (2 * (s - 1) * machine.ar_alpha + 2 * (s - 1) / s * nbytes / machine.ar_beta)
                comm += t
                exposed += t
        elif known is None:
            compute += 3.0 * (in_bytes + out_bytes) / machine.mem_bandwidth * slow
        if split_layer and layer.kind in ("upsample", "pad", "pool", "gpool"):
            t = _exchange_seconds(layer, op, spatial, machine, opts.act_bytes * batch)
            comm += t
            exposed += t
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
        saved += saved_shell
        if layer.spec.startswith("MaxPool"):
            saved += math.prod(out_local) * 8 * batch
        kept.append(saved)
        working.append(in_bytes + out_bytes + _native_columns(layer, op, batch, machine))
    loss = _voxel_loss_bytes(layers, local_ops(layers, spatial)[-1].out_local, batch, opts)
    act = model_input + _peak_activations(kept, working, [l.block for l in layers], opts.recompute, loss)
    if opts.recompute:
        compute *= 4.0 / 3.0  # one more forward
    # Gradients: a sum over every rank; a sharded weight's columns only a mean over the data group.
    whole, shard = params - sharded, sharded / s
    allreduce = 0.0
    if world > 1:
        allreduce = 2 * (world - 1) * machine.ar_alpha + 2 * (world - 1) / world * whole * 4 / machine.ar_beta
    if data > 1 and shard:
        allreduce += 2 * (data - 1) * machine.ar_alpha + 2 * (data - 1) / data * shard * 4 / machine.ar_beta
    rank_params = whole + shard
    # The optimiser reads weights, gradients and its states and writes weights and states.
    optimizer = rank_params * 4 * (3 + 2 * opts.optimizer_states) / machine.mem_bandwidth * slow
    step = compute + exposed + allreduce + overhead + optimizer
    memory = machine.baseline_memory + rank_params * 4 * (2 + opts.optimizer_states) + act
    kfac = opts.kfac.predict(machine, data, spatial, opts.global_batch) if opts.kfac is not None else {}
    step += kfac.get("kfac_s", 0.0)
    memory += kfac.get("kfac_memory_bytes", 0.0)
    read = opts.stored_bytes_per_voxel * math.prod(layers[0].in_shape[1:]) / s * batch
    # Every rank reads its block at once from a shared file system of a stated bandwidth; the
    # reader works ahead, so the step waits only for what the compute does not cover.
    fs_read = read * world / opts.fs_bandwidth if opts.fs_bandwidth else 0.0
    wait = max(0.0, fs_read - step)
    step += wait
    return {**kfac, "step_s": step, "fs_read_s": fs_read, "io_wait_s": wait, "compute_s": compute, "halo_s": comm, "exposed_comm_s": exposed,
            "allreduce_s": allreduce, "overhead_s": overhead, "optimizer_s": optimizer, "memory_bytes": memory,
            "activation_bytes": act, "read_bytes": read, "io_s": read / machine.io_bandwidth,
            "measured_layers": measured / max(len(layers), 1)}


def overlap_pays(machine: Machine, conv: Any, shell: Any, x_shape: Sequence[int]) -> bool:
    """``overlap_halo="auto"`` for one split convolution (``parallel.layers.conv``): whether
    the messages it would hide (``alpha + bytes / beta`` each, forward and backward), up to
    its block's convolution time, outweigh the overlapped path's hand-off
    (``machine.overlap_overhead``, twice: forward and backward)."""
    from parallel.split.shell import extent

    n, cin = x_shape[0], x_shape[1]
    elem = 4
    msgs, nbytes = 0, 0.0
    for i, st in enumerate(shell.steps):
        ext = extent(x_shape, shell.steps, i)
        row = math.prod(ext) / max(ext[st.dim], 1) * elem
        msgs += len(st.plan.sends) + len(st.plan.recvs)
        nbytes += row * sum(m for _, pieces in st.plan.sends for _, m in pieces)
    halo = msgs * machine.p2p_alpha + nbytes / machine.p2p_beta
    k = conv.kernel_size[0]
    voxels = math.prod(shell.out_len)
    flops = 2.0 * cin // conv.groups * math.prod(conv.kernel_size) * conv.out_channels * voxels * n
    forward = flops / machine.flops(cin, conv.out_channels, k, voxels * n)
    return min(halo, forward) + min(halo, 2 * forward) > 2 * machine.overlap_overhead


def overlap_policy(machine: Machine | None = None) -> Callable[[Any, Any, Sequence[int]], bool]:
    """``overlap_halo="auto"``, as the policy ``parallelize`` hands each split convolution
    (asked per geometry at its first forward): ``overlap_pays`` with ``machine``'s figures,
    by default the calibration (``Machine.load``), else the generic ones with a warning."""
    if machine is None:
        try:
            machine = Machine.load(None)
        except (OSError, ValueError) as err:
            log.warning("overlap_halo=auto: %s; using the generic machine figures", err)
            machine = Machine()
    return functools.partial(overlap_pays, machine)
