"""The planner's tables (docs/benchmarks/plan512_*.md): Oyama et al.'s 512^3 CosmoFlow result on Lassen
(predicted against reported), and 512^3 CosmoFlow and U-Net on H100/H200-class nodes.

    python scripts/plan_report.py lassen      # CosmoFlow 512^3, mini-batch 64, 512 and 2048 V100s
    python scripts/plan_report.py h200        # smallest split, fastest split per GPU count, I/O
    python scripts/plan_report.py h200 --node h100 --batch 32
    python scripts/plan_report.py target      # time to the target: where a split overtakes data parallelism

Every figure is a prediction of ``parallel.plan`` with the node descriptions of
``parallel.plan.machines`` (public specifications and stated assumptions); nothing here
was measured on those machines. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel import plan
from parallel.plan.local import valid
from parallel.plan.machines import NODES, Node, predict_on

COSMO512 = ["model.n_conv_blocks=7", "model.max_filters=512"]  # configs/cosmoflow/mlperf512.yaml's network
GIB = 2**30


def _layers(family: str, size: int, overrides: list[str]) -> tuple[list[plan.Layer], float]:
    model, shape, stored = plan.build_model(family, (size,) * 3, overrides)
    return plan.trace(model, shape), stored


def _spatials(s: int, layers: list[plan.Layer]) -> list[tuple[int, int, int]]:
    out = []
    for sd in range(1, s + 1):
        for sh in range(1, s // sd + 1):
            if s % (sd * sh) == 0 and sd >= sh >= s // (sd * sh) and valid(layers, (sd, sh, s // (sd * sh))):
                out.append((sd, sh, s // (sd * sh)))
    return out


def _row(r: dict[str, Any]) -> str:
    return (f"| {r['gpus']} | {r['data']} x {'x'.join(map(str, r['spatial']))} | {r['step_s']:.3f} | "
            f"{r['compute_s']:.3f} | {r['exposed_comm_s'] + r['allreduce_s']:.3f} | "
            f"{r['memory_bytes'] / GIB:.1f} | {'yes' if r['fits'] else 'no'} | "
            f"{r['node_read_bandwidth'] / 1e9:.1f} | {r['job_read_bandwidth'] / 1e9:.0f} |")


HEAD = ("| GPUs | data x spatial | step s | compute s | comm s | GiB per GPU | fits | "
        "read GB/s per node | read GB/s, job |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def lassen(args: argparse.Namespace) -> None:
    """CosmoFlow 512^3 at mini-batch 64 on 512 and 2048 V100s: every spatial split of 8 and 32."""
    node = NODES["lassen"]
    layers, stored = _layers("cosmoflow", 512, COSMO512)
    opts = plan.Options(global_batch=64, stored_bytes_per_voxel=stored)
    print(f"CosmoFlow 512^3 ({' '.join(COSMO512)}), fp32, mini-batch 64, one sample per spatial group, on "
          f"{node.name} ({node.gpus} x {node.memory / 1e9:.0f} GB per node)\n")
    print(HEAD)
    best: dict[int, dict[str, Any]] = {}
    for gpus in (512, 2048):
        s = gpus // 64
        for sp in _spatials(s, layers):
            r = predict_on(node, layers, 64, sp, opts)
            print(_row(r))
            if r["fits"] and (gpus not in best or r["step_s"] < best[gpus]["step_s"]):
                best[gpus] = r
    if len(best) == 2:
        a, b = best[512], best[2048]
        print(f"\nfastest that fits: 512 GPUs {'x'.join(map(str, a['spatial']))} {a['step_s']:.3f} s, 2048 GPUs "
              f"{'x'.join(map(str, b['spatial']))} {b['step_s']:.3f} s: predicted speedup {a['step_s'] / b['step_s']:.2f}x "
              "(reported: about 2x)")
    small = plan.smallest_fit(layers, _machine(node), node.memory, plan.Options(global_batch=1, stored_bytes_per_voxel=stored))
    if small is not None:
        print(f"smallest split that fits a 16 GB V100 at one sample per group: {'x'.join(map(str, small['spatial']))} "
              f"({small['memory_bytes'] / GIB:.1f} GiB)")


def _machine(node: Node) -> plan.Machine:
    from parallel.plan.machines import machine_for

    return machine_for(node, 1, (node.gpus, 1, 1))


def today(args: argparse.Namespace) -> None:
    """512^3 CosmoFlow and U-Net on H100/H200-class nodes: smallest fit, fastest per GPU count."""
    node = NODES[args.node]
    for family, overrides, batch in (("cosmoflow", COSMO512, args.batch), ("unet3d", [], args.unet_batch)):
        layers, stored = _layers(family, 512, overrides)
        opts = plan.Options(global_batch=batch, stored_bytes_per_voxel=stored)
        small = plan.smallest_fit(layers, _machine(node), node.memory,
                                  plan.Options(global_batch=1, stored_bytes_per_voxel=stored))
        print(f"\n{family} 512^3 ({' '.join(overrides) or 'MLPerf network'}), fp32, global batch {batch}, "
              f"{node.name} nodes ({node.gpus} x {node.memory / 1e9:.0f} GB):")
        if small is not None:
            print(f"smallest split that fits one GPU at one sample per group: "
                  f"{'x'.join(map(str, small['spatial']))} ({small['memory_bytes'] / GIB:.1f} GiB per GPU)\n")
        print(HEAD)
        gpus = max(1, math.prod(small["spatial"]) if small is not None else 1)
        while gpus <= args.max_gpus:
            rows = []
            for d in range(1, batch + 1):
                if gpus % d or batch % d:
                    continue
                for sp in _spatials(gpus // d, layers):
                    rows.append(predict_on(node, layers, d, sp, opts))
            fitting = [r for r in rows if r["fits"]]
            if fitting:
                print(_row(min(fitting, key=lambda r: r["step_s"])))
            gpus *= 2


# MLPerf HPC CosmoFlow reference convergence at 128^3 (docs: REFERENCE facts): epochs to the
# target at global batch 64..1024 over 524,288 samples an epoch, as [batch, steps]; the fit of
# S(B) = S_min (1 + B_noise / B) to them (batch 32, slower than 64 in the reference, left out).
REFERENCE_STEPS_128 = [[b, e * 524288 / b] for b, e in ((64, 18.3), (128, 17.9), (512, 22.8), (1024, 40.0))]


def target(args: argparse.Namespace) -> None:
    """Time to the target of 512^3 CosmoFlow on Lassen and H200-class nodes: at each GPU
    count, data parallelism on the smallest split that fits (the batch grows with the GPUs)
    against the split and batch fastest to the target."""
    from parallel.plan.target import StepsModel, fit

    ref = fit(REFERENCE_STEPS_128)
    b_noise = args.b_noise if args.b_noise is not None else ref.b_noise / 64
    model = StepsModel(s_min=ref.s_min, b_noise=b_noise)
    layers, stored = _layers("cosmoflow", 512, COSMO512)
    print(f"Steps to the target at 512^3: S(B) = {model.s_min:.0f} (1 + {model.b_noise:.1f} / B), an ASSUMPTION: "
          f"S(B) fitted to the MLPerf reference's 128^3 convergence (B_noise {ref.b_noise:.0f} crops, S_min "
          f"{ref.s_min:.0f} steps), B_noise taken {ref.b_noise / b_noise:.0f}x smaller for a 512^3 box of 64 crops "
          "(if the crops' gradients were independent), S_min kept; learning rate scaled linearly with the batch.\n")
    for name in ("lassen", args.node):
        node = NODES[name]
        small = plan.smallest_fit(layers, _machine(node), node.memory,
                                  plan.Options(global_batch=1, stored_bytes_per_voxel=stored))
        if small is None:
            print(f"{name}: no split fits")
            continue
        s0 = math.prod(small["spatial"])
        print(f"{name} ({node.gpus} x {node.memory / 1e9:.0f} GB per node), smallest split that fits: "
              f"{'x'.join(map(str, small['spatial']))}\n")
        print("| GPUs | data growth: data x spatial, batch | step s | steps | hours to target | fastest to target: "
              "data x spatial, batch | step s | steps | hours | gain |\n| --- | --- | --- | --- | --- | --- | --- | "
              "--- | --- | --- |")
        crossover = None
        gpus = s0
        while gpus <= args.max_gpus:
            rows = []
            for s in (x for x in range(s0, gpus + 1) if gpus % x == 0):
                d = gpus // s
                for sp in _spatials(s, layers):
                    for local in (1, 2):
                        r = predict_on(node, layers, d, sp, plan.Options(global_batch=d * local,
                                                                         stored_bytes_per_voxel=stored))
                        if r["fits"]:
                            r.update(global_batch=d * local, steps=model.steps(d * local))
                            r["hours"] = r["steps"] * r["step_s"] / 3600
                            rows.append(r)
            growth = [r for r in rows if math.prod(r["spatial"]) == s0 and r["global_batch"] == r["data"]]
            if rows and growth:
                g, best = min(growth, key=lambda r: r["hours"]), min(rows, key=lambda r: r["hours"])
                if crossover is None and math.prod(best["spatial"]) > s0 and best["hours"] < g["hours"]:
                    crossover = gpus
                print(f"| {gpus} | {g['data']} x {'x'.join(map(str, g['spatial']))}, {g['global_batch']} | "
                      f"{g['step_s']:.3f} | {g['steps']:.0f} | {g['hours']:.2f} | {best['data']} x "
                      f"{'x'.join(map(str, best['spatial']))}, {best['global_batch']} | {best['step_s']:.3f} | "
                      f"{best['steps']:.0f} | {best['hours']:.2f} | {g['hours'] / best['hours']:.2f}x |")
            gpus *= 2
        print(f"\nthe spatial split overtakes data parallelism in time to the target from "
              f"{crossover if crossover else 'no count up to ' + str(args.max_gpus)} GPUs\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("lassen", "h200", "target"))
    p.add_argument("--b-noise", type=float, default=None,
                   help="target: B_noise of 512^3 samples (default: the reference's 128^3 fit / 64, an assumption)")
    p.add_argument("--node", choices=sorted(NODES), default="h200", help="node kind for 'h200' (default %(default)s)")
    p.add_argument("--batch", type=int, default=64, help="CosmoFlow's global batch (default %(default)s)")
    p.add_argument("--unet-batch", type=int, default=16, help="the U-Net's global batch (default %(default)s)")
    p.add_argument("--max-gpus", type=int, default=2048)
    args = p.parse_args(argv)
    {"lassen": lassen, "h200": today, "target": target}[args.what](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
