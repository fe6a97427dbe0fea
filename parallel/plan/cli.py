"""The command line of ``python -m parallel.plan``: one row per split, fastest first."""

from __future__ import annotations

import argparse
import json
import math
import sys

from parallel.job.family import get, names
from parallel.model.trace import trace
from parallel.plan.cost import Options
from parallel.plan.machine import Machine, default_calibration
from parallel.plan.models import build_model
from parallel.plan.search import table
from parallel.runtime.memory import parse_bytes


def family_name(text: str) -> str:
    """An argparse ``type``: a known family name (or ``module:attr``)."""
    try:
        get(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _description() -> str:
    import parallel.plan

    return parallel.plan.__doc__ or ""



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m parallel.plan", description=_description(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=names()[0], type=family_name,
                   help="model family (configs/families.yaml, or module:attr; default %(default)s)")
    p.add_argument("--size", type=int, nargs="+", default=[128], help="sample D H W (one number: a cube)")
    p.add_argument("--set", nargs="*", default=[], help="model overrides, e.g. model.n_conv_blocks=7; "
                   "model._target_=pkg.Class plans that network (its keyword arguments as model.<name>=value)")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--device-memory", default="inf", help="bytes per device, e.g. 80GB")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: devices)")
    p.add_argument("--calibration", default=None, help=f"JSON from calibrate (default {default_calibration()})")
    p.add_argument("--compute-scale", type=float, default=1.0, help="device flop/s over the calibrated rank's")
    p.add_argument("--alpha", type=float, default=None, help="network latency, seconds per message")
    p.add_argument("--bandwidth", type=float, default=None, help="network bytes/s per link")
    p.add_argument("--io-bandwidth", type=float, default=None, help="storage bytes/s per rank")
    p.add_argument("--fs-bandwidth", type=float, default=None,
                   help="shared file system bytes/s, all ranks together: the step waits for data when its reads "
                        "take longer than its compute, and the plan says which measure removes the wait")
    p.add_argument("--samples", type=int, default=None, help="training samples (an epoch), with --fs-bandwidth")
    p.add_argument("--epochs", type=int, default=50, help="epochs a run trains (staging is spread over them)")
    p.add_argument("--ranks-per-node", type=int, default=4, help="ranks a node holds (today's staging: per node)")
    p.add_argument("--codec-ratio", type=float, default=2.5,
                   help="a codec's compression ratio on these samples (scripts/benchmark.py io measures it)")
    p.add_argument("--generic", choices=("cpu", "gpu"), default=None,
                   help="use the built-in figures of this kind of machine instead of a calibration")
    p.add_argument("--node-ranks", type=int, default=1,
                   help="ranks sharing one machine's cores (CPU ranks per node; 1: one GPU per rank)")
    p.add_argument("--overlap", action="store_true", help="halo exchanges beside the block's convolution")
    p.add_argument("--overlap-auto", action="store_true", help="overlapped per layer where it pays (as "
                                                                 "parallel.overlap_halo=auto)")
    p.add_argument("--recompute", action="store_true", help="activation checkpointing per block")
    p.add_argument("--optim", choices=["sgd", "adamw", "kfac"], default="sgd",
                   help="optimiser: its state in memory; kfac adds its factor, inverse and "
                        "preconditioning work, all-reduces and memory (docs/kfac.md)")
    p.add_argument("--kfac", nargs="*", default=[], metavar="KEY=VALUE",
                   help="K-FAC settings as in optim.kfac, e.g. factor_interval=5 damping=0.01")
    p.add_argument("--target", nargs="?", const="default", default=None, metavar="FIT",
                   help="rank (split, global batch) by predicted time to the quality target: steps from the "
                        "S(B) fit of python -m parallel.plan.target (default: target.json beside the "
                        "calibration) x predicted step time")
    p.add_argument("--batches", default=None,
                   help="with --target: global batches to consider, comma-separated (default: every split's "
                        "data size x 1, 2, 4, 8 samples per data group)")
    p.add_argument("--top", type=int, default=12, help="with --target: rows shown (0: all; the marked rows always)")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    args = p.parse_args(argv)
    size = args.size * 3 if len(args.size) == 1 else args.size
    try:
        model, in_shape, stored = build_model(args.model, size, args.set)
    except ValueError as err:  # a model override that cannot build (model._target_=..., a bad key)
        print(f"parallel.plan: {err}", file=sys.stderr)
        return 2
    layers = trace(model, in_shape)
    kfac = None
    if args.optim == "kfac" or args.kfac:
        from parallel.plan.kfac import KFACPlan, kfac_config

        try:
            kfac = KFACPlan(model, in_shape, kfac_config(args.kfac))
        except ValueError as err:
            print(f"parallel.plan: {err}", file=sys.stderr)
            return 2
    try:
        m = Machine.generic_machine(args.generic) if args.generic else Machine.load(args.calibration)
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
                   overlap="auto" if args.overlap_auto else args.overlap, recompute=args.recompute,
                   optimizer_states=2 if args.optim == "adamw" else 1, kfac=kfac,
                   node_ranks=args.node_ranks, shard_linear=args.optim != "kfac", fs_bandwidth=args.fs_bandwidth)
    if args.target is not None:
        from parallel.plan.target_table import print_target_table

        return print_target_table(args, layers, m, opts, parse_bytes(args.device_memory), size)
    rows = table(layers, m, args.devices, parse_bytes(args.device_memory), opts)
    if args.json:
        for r in rows:
            print(json.dumps({**r, "machine": m.label, "generic": m.generic}))
        return 0
    print(f"machine: {m.label}")
    print(f"{args.model} {'x'.join(map(str, size))}, {args.devices} devices, global batch {opts.global_batch}, "
          f"memory limit {args.device_memory} per device")
    wait = args.fs_bandwidth is not None  # a column for the step's wait for data
    print(f"{'data':>5} {'spatial':>9} {'step s':>9} {'compute':>9} {'comm':>8} {'mem/rank GiB':>13} "
          f"{'read/rank MiB':>14}  " + (f"{'wait s':>7}  " if wait else ""))
    for r in rows:
        mark = "<- fastest that fits" if r["best"] else ("" if r["fits"] else "(does not fit)")
        print(f"{r['data']:>5} {'x'.join(map(str, r['spatial'])):>9} {r['step_s']:>9.3f} {r['compute_s']:>9.3f} "
              f"{r['exposed_comm_s'] + r['allreduce_s']:>8.3f} {r['memory_bytes'] / 2**30:>13.2f} "
              f"{r['read_bytes'] / 2**20:>14.1f}  " + (f"{r['io_wait_s']:>7.3f}  " if wait else "") + mark)
    if kfac is not None and rows:
        _kfac_lines(next((r for r in rows if r["best"]), rows[0]), kfac.cfg)
    if args.fs_bandwidth and rows:
        best = next((r for r in rows if r["best"]), rows[0])
        _io_lines(best, args, stored * math.prod(size))
    return 0


def _io_lines(r: dict, args: argparse.Namespace, sample_bytes: float) -> None:
    """The shared file system's part for one row: the wait, and the measures that remove it."""
    from parallel.plan.io import Measure, advice, describe

    s = math.prod(r["spatial"])
    measures = [Measure("block reads"), Measure("whole-sample reads", whole=True),
                Measure(f"block reads, codec ratio {args.codec_ratio:g}", ratio=args.codec_ratio),
                Measure("staging", staging="each"), Measure("read-once staging", staging="once"),
                Measure(f"read-once staging, codec ratio {args.codec_ratio:g}", staging="once", ratio=args.codec_ratio)]
    samples = args.samples or args.batch or args.devices
    a = advice(measures, measures[0], samples=samples, sample_bytes=sample_bytes, data=r["data"], spatial=s,
               nodes=max(1, math.ceil(args.devices / args.ranks_per_node)), fs_bandwidth=args.fs_bandwidth,
               compute_step_s=r["step_s"] - r["io_wait_s"], epochs=args.epochs, batch=args.batch or args.devices)
    print(f"shared file system, {r['data']} x {'x'.join(map(str, r['spatial']))}, {samples} samples, "
          f"{args.epochs} epochs:")
    for line in describe(a, args.fs_bandwidth):
        print(f"  {line}")


def _kfac_lines(r: dict, cfg: object) -> None:
    """K-FAC's share of one row's step (included in its step time and memory above)."""
    print(f"K-FAC on {r['data']} x {'x'.join(map(str, r['spatial']))} (included above), per step on average: "
          f"{r['kfac_s']:.3f} s = factors {r['kfac_factor_s']:.3f} + inverses {r['kfac_inverse_s']:.3f} + "
          f"preconditioning {r['kfac_precondition_s']:.3f} + all-reduce {r['kfac_allreduce_s']:.3f} + "
          f"broadcast {r['kfac_broadcast_s']:.3f}; memory {r['kfac_memory_bytes'] / 2**30:.2f} GiB per rank")
    print(f"  factor update every {getattr(cfg, 'factor_interval')} steps: {r['kfac_factor_flops']:.3g} flops, "
          f"{r['kfac_factor_allreduce_bytes'] / 2**20:.1f} MiB all-reduced; inverse update every "
          f"{getattr(cfg, 'inverse_interval')} steps: {r['kfac_inverse_flops']:.3g} flops on the busiest rank")
    plain = r["kfac_plain_layers"]
    print(f"  {r['kfac_layers']} layers preconditioned; plain update: {', '.join(plain) if plain else 'none'}")
    low = r.get("kfac_low_rank_layers")
    if low:
        print(f"  low rank plus diagonal (wider than kfac.max_factor_dim): {', '.join(low)}")
