"""Compute benchmarks per grid: the halo overhead of a split convolution (``layer``), and
the models' step time (``step``) and peak memory per rank (``memory``), each beside what
``parallel.plan`` predicts for it."""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from parallel.bench import device as dev
from parallel.bench.shared import Rows, overrides_of, plot, sizes
from parallel.bench.timing import load
from parallel.job.family import get, names


# -- layer ------------------------------------------------------------------------------

def layer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", type=int, default=64, help="global cube edge")
    p.add_argument("--channels", type=int, default=32)
    p.add_argument("--kernel", type=int, default=3)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--splits", default="2x1x1", help="comma list of grids, e.g. 2x1x1,1x2x1")
    p.add_argument("--trials", type=int, default=9)


def layer(args: argparse.Namespace) -> Rows:
    """Halo overhead: spatial conv fwd and bwd (blocking, overlapped, whole window) over the best
    plain conv on the same block, and over the conv of a window cut beforehand."""
    from parallel.bench.layer import conv_overhead
    from parallel.bench.ranks import run_ranks

    summary: dict[str, Any] = {
        "kind": "summary", "command": "layer", "load_before": load(),
        "includes": "forward+backward seconds of the split conv (its halo exchange included, no gradient "
                    "all-reduce) over the faster plain conv of the same rank's block with no communication "
                    "(halo_fair*), or over the conv of a window cut beforehand (halo_vs_window*); each trial the "
                    "slowest rank's, medians of per-trial ratios of interleaved trials"}
    for text in args.splits.split(","):
        spatial = sizes(text)
        world = math.prod(spatial)
        r = run_ranks(world, conv_overhead, args.size, args.channels, args.kernel, args.batch, args.trials,
                      spatial=spatial)[0]
        row = {"kind": "layer", "spatial": spatial, "size": args.size, "channels": args.channels,
               "kernel": args.kernel, **r}
        yield row
        # The fair ratio (fwd+bwd over the best plain conv on the block) of the default path
        # first; forward and backward apart, the overlapped and whole-window paths beside it.
        for v, key in (("blocking", ""), ("overlap", "_overlap"), ("window_exchange", "_window_exchange")):
            summary[f"halo_fair{key}_{text}"] = r["fair"][v]["total"]
            summary[f"halo_fair{key}_forward_{text}"] = r["fair"][v]["forward"]
            summary[f"halo_fair{key}_backward_{text}"] = r["fair"][v]["backward"]
            summary[f"halo_fair{key}_cpu_{text}"] = r["fair"][v]["cpu"]
            summary[f"halo_vs_window{key}_{text}"] = r["vs_window"][v]["total"]
        summary[f"halo_fair_best_{text}"] = min(r["fair"]["blocking"]["total"], r["fair"]["overlap"]["total"])
    summary["load_after"] = load()
    yield summary


# -- step -------------------------------------------------------------------------------

def step_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=",".join(names()))
    p.add_argument("--size", default="64", help="sample cube edge (or DxHxW)")
    p.add_argument("--batch", type=int, default=2, help="global batch")
    p.add_argument("--trials", type=int, default=5)
    for name in names():
        small = get(name).bench_overrides
        p.add_argument(f"--{name}-set", nargs="*", default=list(small),
                       help=f"model overrides for {name} (default: {' '.join(small) or 'none'})")
    p.add_argument("--no-weak", action="store_true")
    p.add_argument("--overlap", nargs="?", const="true", default="false", choices=("false", "true", "auto"),
                   help="the halo exchanges beside each conv's block (auto: per layer, from the calibration)")
    p.add_argument("--spatial", default="2x1x1", help="the 2-way split (default along D, as the readers slab)")
    p.add_argument("--calibration", default=None, help="plan calibration (default: measure it now if missing)")
    p.add_argument("--optim", choices=["sgd", "kfac"], default="sgd",
                   help="kfac: time K-FAC's plain, factor-update and inverse-update steps against SGD's "
                        "on the 2-way split instead (parallel/bench/kfac.py)")
    p.add_argument("--kfac", nargs="*", default=[], metavar="KEY=VALUE", help="K-FAC settings (optim.kfac)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per rank: 2 GPUs)")
    p.add_argument("--sync-world", type=int, default=4,
                   help="ranks (data x the 2-way split) at which the step with the gradient noise scale measured "
                        "(the hierarchical sync) is timed beside the flat all-reduce's (0: skip)")
    p.add_argument("--channels-last", action="store_true",
                   help="time each model NDHWC against NCDHW instead, serial and split (parallel/bench/layout.py)")


def _overlap(text: str) -> bool | str:
    return {"false": False, "true": True}.get(text, text)


def _machine(args: argparse.Namespace, cases: list) -> Any:
    """The calibration (measured now if missing), with the local layer times of ``cases``
    (``parallel.bench.layer_times.Case``, one per grid the benchmark predicts) added if absent."""
    from parallel.bench.calibrate import calibrate, ensure_layer_seconds
    from parallel.plan import Machine, default_calibration

    path = Path(args.calibration) if args.calibration else default_calibration()
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        device = dev.parse(getattr(args, "device", "cpu"))
        path.write_text(json.dumps(calibrate(cases, device=device), indent=1), encoding="utf-8")
    ensure_layer_seconds(path, cases)
    return Machine.load(path)


def step(args: argparse.Namespace) -> Rows:
    """Step time per grid (serial, spatial 2, data 2, weak spatial 2), measured and predicted."""
    from parallel.bench.layer_times import Case
    from parallel.bench.ranks import run_ranks
    from parallel.bench.step import step_times
    from parallel.plan import Options, build_model, predict, trace

    if args.optim == "kfac":
        from parallel.bench.kfac import kfac_step

        yield from kfac_step(args)
        return
    if args.channels_last:
        from parallel.bench.layout import layout_step

        yield from layout_step(args)
        return
    size = sizes(args.size)
    split = tuple(sizes(args.spatial))
    device = dev.parse(args.device)
    if math.prod(split) != 2:
        raise SystemExit(f"--spatial {args.spatial}: the step benchmark compares 2-way splits")
    summary: dict[str, Any] = {
        "kind": "summary", "command": "step", "spatial": list(split), "load_before": load(),
        "includes": "seconds of a training step (forward, loss, backward with the gradient all-reduce, SGD "
                    "update) on a synthetic batch already in memory, no data loading; each trial the slowest "
                    "rank's; *_over_serial: medians of per-trial ratios of interleaved trials (floor2: both ranks "
                    "running the plain model on a block-sized volume, no communication); prediction errors: "
                    "parallel.plan's step from the calibration against the median measured step, worst grid; "
                    "*_noise_over_flat_*: the step with the gradient noise scale measured (train.noise_scale: the "
                    "hierarchical sync where the sample is split) over the step with one all-reduce, interleaved, "
                    "*_flat_spread_*: the flat step against itself (the run-to-run spread)"}
    plotted: dict[str, tuple[dict[str, float], dict[str, float]]] = {}
    for name in args.models.split(","):
        over = overrides_of(args, name)
        weak = None if args.no_weak else [n * s for n, s in zip(size, split)]
        r = run_ranks(2, step_times, name, size, over, args.batch, args.trials, weak, _overlap(args.overlap),
                      spatial=split, device=device.type)[0]
        model, in_shape, stored = build_model(name, size, over)
        layers = trace(model, in_shape)
        # Both ranks run on this machine: the multi-rank grids' layers run beside each other
        # (timed busy in the calibration); on GPUs each rank has its own device.
        opts = Options(global_batch=args.batch, stored_bytes_per_voxel=stored, overlap=_overlap(args.overlap),
                       node_ranks=2 if device.type == "cpu" else 1)
        grids = {"serial": (1, (1, 1, 1), layers, size), "spatial2": (1, split, layers, size),
                 "data2": (2, (1, 1, 1), layers, size)}
        if weak is not None:
            wmodel, win, _ = build_model(name, weak, over)
            grids["spatial2_weak"] = (1, split, trace(wmodel, win), weak)
        # Each layer's local computation is timed without communication, alone for the serial
        # grid and with both ranks computing for the others; the model adds the exchanges,
        # the gradient all-reduce and the optimiser.
        cases = [Case(name, tuple(sz), tuple(over), tuple(sp), math.ceil(args.batch / d), d * math.prod(sp) > 1)
                 for d, sp, _, sz in grids.values()]
        machine = _machine(args, cases)
        predicted = {k: predict(ls, machine, d, sp, opts)["step_s"] for k, (d, sp, ls, _) in grids.items()}
        # The calibration's layer times are medians of their trials, so a prediction compares
        # with the median step; the error against the best step is kept beside it.
        error = {k: predicted[k] / r["seconds"][k] - 1 for k in r["seconds"] if k in predicted}
        error_best = {k: predicted[k] / r["best_seconds"][k] - 1 for k in r["best_seconds"] if k in predicted}
        yield {"kind": "step", "model": name, "size": size, "batch": args.batch, "set": over,
               "measured_median_s": r["seconds"], "measured_best_s": r["best_seconds"], "predicted_s": predicted,
               "prediction_error": error, "prediction_error_vs_best": error_best,
               **{k: v for k, v in r.items() if k not in ("seconds", "best_seconds")}}
        summary[f"{name}_spatial2_over_serial"] = r["strong_ratio_spatial2"]
        summary[f"{name}_spatial2_over_serial_best"] = r["best_seconds"]["spatial2"] / r["best_seconds"]["serial"]
        if "strong_ratio_data2" in r:
            summary[f"{name}_data2_over_serial"] = r["strong_ratio_data2"]
        if "weak_efficiency_spatial2" in r:
            summary[f"{name}_weak_efficiency_spatial2"] = r["weak_efficiency_spatial2"]
        if "noise_over_flat_data2" in r:
            summary[f"{name}_noise_over_flat_data2"] = r["noise_over_flat_data2"]
        if args.sync_world:
            from parallel.bench.step import sync_times

            if args.sync_world % 2 or args.sync_world < 4 or args.batch % (args.sync_world // 2):
                raise SystemExit(f"--sync-world {args.sync_world}: needs data >= 2 groups of the 2-way split and a "
                                 f"--batch ({args.batch}) they divide")
            sync = run_ranks(args.sync_world, sync_times, name, size, over, args.batch, args.trials,
                             spatial=split, device=device.type)[0]
            grid_name = f"data{args.sync_world // 2}x{'x'.join(map(str, split))}"
            yield {"kind": "sync", "model": name, "grid": grid_name, "size": size, "batch": args.batch, **sync}
            summary[f"{name}_noise_over_flat_{grid_name}"] = sync["hierarchical_over_flat"]
            summary[f"{name}_flat_spread_{grid_name}"] = sync["flat_again_over_flat"]
        summary[f"{name}_floor2_over_serial"] = r["floor_ratio_spatial2"]
        summary[f"{name}_worst_prediction_error"] = max(abs(e) for e in error.values())
        summary[f"{name}_worst_prediction_error_vs_best"] = max(abs(e) for e in error_best.values())
        summary["machine"] = machine.label
        plotted[name] = (r["seconds"], predicted)

    def draw(ax: Any) -> None:
        labels, measured, model = [], [], []
        for name, (median, pred) in plotted.items():
            for grid in (g for g in median if g in pred):
                labels.append(f"{name}\n{grid}")
                measured.append(median[grid])
                model.append(pred.get(grid, 0.0))
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], measured, 0.4, label="measured (median trial)")
        ax.bar([x + 0.2 for x in xs], model, 0.4, label="parallel.plan")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("seconds per step")
        ax.set_title(f"step time, {'x'.join(map(str, size))}, global batch {args.batch}")
        ax.legend()

    summary["plot"] = plot(args, "step", draw)
    summary["load_after"] = load()
    yield summary


# -- memory -----------------------------------------------------------------------------

MEMORY_TIMEOUT_S = 3600.0
"""Per grid: a serial 256^3 CosmoFlow step took 5 minutes on 2 quiet cores and went past
run_ranks' default 600 s while other work shared them."""


def memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=names()[0])
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--splits", default="1x1x1,2x1x1,4x1x1")
    p.add_argument("--batch", type=int, default=2, help="samples per step (at 1, the replicated weights, "
                                                         "gradients and momentum are a third of a 4-way rank's peak)")
    p.add_argument("--set", nargs="*", default=[])
    p.add_argument("--recompute", action="store_true", help="also measure with activation checkpointing")
    p.add_argument("--overlap", nargs="?", const="true", default="false", choices=("false", "true", "auto"),
                   help="the halo exchanges beside each conv's block (auto: per layer, from the calibration)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per rank; peak = reserved + context)")
    p.add_argument("--mmap-threshold", type=int, default=1 << 20,
                   help="glibc MALLOC_MMAP_THRESHOLD_ of the ranks: blocks this large are returned to the "
                        "system when freed, so peak RSS measures live tensors, not heap fragmentation (0: glibc's "
                        "dynamic default)")
    p.add_argument("--api", action="store_true",
                   help="measure a user's program instead (serial model, parallelize, scatter of a global batch, "
                        "one forward and backward; parallel.bench.usermem)")
    p.add_argument("--input-shape", action="store_true", help="with --api: pass parallelize(input_shape=...)")
    p.add_argument("--sync-world", type=int, default=4,
                   help="ranks (data x the 2-way split) at which the step with the gradient noise scale measured "
                        "(the hierarchical sync) is timed beside the flat all-reduce's (0: skip)")
    p.add_argument("--channels-last", action="store_true", help="with --api: parallelize(channels_last=True)")
    p.add_argument("--no-warmup", action="store_true",
                   help="with --api: no warm-up run on a tiny model before the baseline, so the figures are the "
                        "program's growth as seen from outside, the first step's one-time runtime costs included")


def memory(args: argparse.Namespace) -> Rows:
    """Peak memory per rank for one step at each grid, beyond the fixed baseline, vs serial."""
    from parallel.bench.ranks import run_ranks
    from parallel.bench.step import peak_memory
    from parallel.plan import Machine, Options, build_model, predict, trace

    if args.mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)  # read by the spawned ranks' libc
    if args.no_warmup and not args.api:
        raise SystemExit("--no-warmup: only with --api (the framework's step always subtracts its warm-up)")
    if args.api:
        yield from _api_memory(args)
        return
    model, in_shape, stored = build_model(args.model, (args.size,) * 3, args.set)
    layers = trace(model, in_shape)
    summary: dict[str, Any] = {
        "kind": "summary", "command": "memory", "load_before": load(), "malloc_mmap_threshold": args.mmap_threshold,
        "includes": "peak resident memory per rank (VmHWM) over one training step (the block cloned as a reader "
                    "gives it, Flatten+Linear weights sharded with input_shape, SGD) above the rank's resident "
                    "memory after a warm-up step of a tiny model (one-time runtime costs subtracted); ratio to the "
                    "serial rank's"}
    serial: dict[bool, float] = {}
    plotted: dict[str, list[tuple[int, float]]] = {}
    machine = Machine.load(None)
    for recompute in ([False, True] if args.recompute else [False]):
        for text in args.splits.split(","):
            spatial = sizes(text)
            world = math.prod(spatial)
            t0 = time.perf_counter()
            ranks = run_ranks(world, peak_memory, args.model, (args.size,) * 3, args.set, args.batch, recompute,
                              _overlap(args.overlap), spatial=spatial, device=dev.parse(args.device).type,
                              timeout=MEMORY_TIMEOUT_S, start="spawn")
            above = max(r["above_baseline"] for r in ranks)
            if world == 1:
                serial[recompute] = above
            base = serial.get(recompute) or serial.get(False)
            # One step: SGD's momentum is created after the backward's peak, so none is counted.
            pred = predict(layers, machine, 1, spatial,
                           Options(global_batch=args.batch, stored_bytes_per_voxel=stored, recompute=recompute,
                                   optimizer_states=0))
            row = {"kind": "memory", "model": args.model, "size": args.size, "spatial": spatial,
                   "recompute": recompute, "peak_bytes_per_rank": max(r["peak_bytes"] for r in ranks),
                   "baseline_bytes": max(r["baseline_bytes"] for r in ranks), "above_baseline_bytes": above,
                   "ratio_to_serial": above / base if base else None,
                   "predicted_activation_bytes": pred["activation_bytes"],
                   "predicted_above_baseline_bytes": pred["memory_bytes"] - machine.baseline_memory,
                   "seconds": time.perf_counter() - t0}
            yield row
            key = f"{'recompute_' if recompute else ''}spatial{world}_over_serial"
            summary[key] = row["ratio_to_serial"]
            summary[f"{'recompute_' if recompute else ''}spatial_{text}_over_serial"] = row["ratio_to_serial"]
            plotted.setdefault("recompute" if recompute else "plain", []).append((world, above / 2**20))

    def draw(ax: Any) -> None:
        for label, pts in plotted.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("spatial ranks")
        ax.set_ylabel("peak MiB per rank above baseline")
        ax.set_title(f"{args.model} {args.size}^3, one step")
        ax.legend()

    summary["plot"] = plot(args, "memory", draw)
    summary["load_after"] = load()
    yield summary


def _api_memory(args: argparse.Namespace) -> Rows:
    """``memory --api``: the user's program per grid; ratios of its peak (everything it
    allocated, the global batch included) and of its forward+backward growth to serial."""
    from parallel.bench.ranks import run_ranks
    from parallel.bench.usermem import api_peak_memory

    warm = not args.no_warmup
    summary: dict[str, Any] = {
        "kind": "summary", "command": "memory --api", "load_before": load(), "input_shape": args.input_shape,
        "channels_last": args.channels_last, "warmup_subtracted": warm,
        "includes": "a user's program: the serial model and a global batch built, parallelize"
                    f"{'(input_shape=...)' if args.input_shape else ' without input_shape'}, scatter, one forward "
                    "and backward; peak resident memory per rank (VmHWM) over the forward and backward, above the "
                    + ("rank's resident memory after the same program ran once on a tiny model (one-time runtime "
                       "costs subtracted)" if warm else "rank's resident memory before the program built anything "
                       "(one-time runtime costs of the first step included, nothing subtracted)")
                    + "; ratio to the serial run's"}
    tag = "" if warm else "_with_one_time_costs"  # the figure's name says what it includes
    serial: dict[str, float] = {}
    for text in args.splits.split(","):
        spatial = sizes(text)
        world = math.prod(spatial)
        t0 = time.perf_counter()
        ranks = run_ranks(world, api_peak_memory, args.model, (args.size,) * 3, args.set, args.batch,
                          args.input_shape, args.channels_last, warm, spatial=spatial,
                          device=dev.parse(args.device).type, timeout=MEMORY_TIMEOUT_S, start="spawn")
        row: dict[str, Any] = {"kind": "memory_api", "model": args.model, "size": args.size, "spatial": spatial,
                               "warmup_subtracted": warm}
        for key in ("peak_bytes", "forward_backward_growth_bytes", "parallelized_bytes", "model_and_batch_bytes",
                    "baseline_bytes"):
            row[key] = max(r[key] for r in ranks)
        for key in ("peak_bytes", "forward_backward_growth_bytes"):
            if world == 1:
                serial[key] = row[key]
            row[key.replace("_bytes", "_ratio_to_serial")] = row[key] / serial[key] if serial.get(key) else None
            summary[f"spatial_{text}_{key.replace('_bytes', '')}{tag}_over_serial"] = \
                row[key.replace("_bytes", "_ratio_to_serial")]
        row["seconds"] = time.perf_counter() - t0
        yield row
    summary["load_after"] = load()
    yield summary
