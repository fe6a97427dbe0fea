"""The command line of ``python -m parallel.plan``: one row per split, fastest first."""

from __future__ import annotations

import argparse
import json
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
                   node_ranks=args.node_ranks, shard_linear=args.optim != "kfac")
    rows = table(layers, m, args.devices, parse_bytes(args.device_memory), opts)
    if args.json:
        for r in rows:
            print(json.dumps({**r, "machine": m.label, "generic": m.generic}))
        return 0
    print(f"machine: {m.label}")
    print(f"{args.model} {'x'.join(map(str, size))}, {args.devices} devices, global batch {opts.global_batch}, "
          f"memory limit {args.device_memory} per device")
    print(f"{'data':>5} {'spatial':>9} {'step s':>9} {'compute':>9} {'comm':>8} {'mem/rank GiB':>13} "
          f"{'read/rank MiB':>14}  ")
    for r in rows:
        mark = "<- fastest that fits" if r["best"] else ("" if r["fits"] else "(does not fit)")
        print(f"{r['data']:>5} {'x'.join(map(str, r['spatial'])):>9} {r['step_s']:>9.3f} {r['compute_s']:>9.3f} "
              f"{r['exposed_comm_s'] + r['allreduce_s']:>8.3f} {r['memory_bytes'] / 2**30:>13.2f} "
              f"{r['read_bytes'] / 2**20:>14.1f}  {mark}")
    if kfac is not None and rows:
        _kfac_lines(next((r for r in rows if r["best"]), rows[0]), kfac.cfg)
    return 0


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
