"""The subcommands of ``scripts/benchmark.py``: each adds its arguments and yields JSON rows."""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from parallel.bench.timing import load

Rows = Iterator[dict[str, Any]]


def _sizes(text: str) -> list[int]:
    return [int(v) for v in text.split("x")] if "x" in text else [int(text)] * 3


def _plot(args: argparse.Namespace, name: str, draw: Callable[[Any], None]) -> str | None:
    """A PNG under ``--plot`` if matplotlib is installed; its path, or None."""
    if args.plot is None:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    args.plot.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    draw(ax)
    fig.tight_layout()
    path = args.plot / f"{name}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


# -- layer ------------------------------------------------------------------------------

def _layer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", type=int, default=64, help="global cube edge")
    p.add_argument("--channels", type=int, default=32)
    p.add_argument("--kernel", type=int, default=3)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--splits", default="2x1x1", help="comma list of grids, e.g. 2x1x1,1x2x1")
    p.add_argument("--trials", type=int, default=9)


def layer(args: argparse.Namespace) -> Rows:
    """Halo overhead: spatial conv fwd+bwd (overlapped and blocking) over the plain local conv."""
    from parallel.bench.layer import conv_overhead
    from parallel.bench.ranks import run_ranks

    summary: dict[str, Any] = {"kind": "summary", "command": "layer", "load_before": load()}
    for text in args.splits.split(","):
        spatial = _sizes(text)
        world = math.prod(spatial)
        r = run_ranks(world, conv_overhead, args.size, args.channels, args.kernel, args.batch, args.trials,
                      spatial=spatial)[0]
        row = {"kind": "layer", "spatial": spatial, "size": args.size, "channels": args.channels,
               "kernel": args.kernel, **r}
        yield row
        # The default path (blocking) first; the overlapped one beside it.
        summary[f"halo_overhead_{text}"] = r["overhead"]["blocking"]
        summary[f"halo_overhead_overlap_{text}"] = r["overhead"]["overlap"]
        summary[f"halo_overhead_vs_window_{text}"] = r["overhead_vs_window"]["blocking"]
        summary[f"halo_overhead_vs_window_overlap_{text}"] = r["overhead_vs_window"]["overlap"]
    summary["load_after"] = load()
    yield summary


# -- step -------------------------------------------------------------------------------

def _step_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="cosmoflow,unet3d")
    p.add_argument("--size", default="64", help="sample cube edge (or DxHxW)")
    p.add_argument("--batch", type=int, default=2, help="global batch")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--cosmoflow-set", nargs="*", default=[], help="model overrides for CosmoFlow")
    p.add_argument("--unet3d-set", nargs="*", default=["model.depth=3", "model.base_filters=8"],
                   help="model overrides for the U-Net (default: a small one)")
    p.add_argument("--no-weak", action="store_true")
    p.add_argument("--overlap", action="store_true", help="hide the halo exchanges behind the interior")
    p.add_argument("--spatial", default="2x1x1", help="the 2-way split (default along D, as the readers slab)")
    p.add_argument("--calibration", default=None, help="plan calibration (default: measure it now if missing)")


def _machine(args: argparse.Namespace, cases: list) -> Any:
    """The calibration (measured now if missing), with the local layer times of ``cases``
    ((layers, spatial, local batch) for each grid the benchmark predicts) added if absent."""
    from parallel.bench.calibrate import calibrate, ensure_layer_seconds
    from parallel.plan import DEFAULT_CALIBRATION, Machine

    path = Path(args.calibration) if args.calibration else DEFAULT_CALIBRATION
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(calibrate([l for ls, _, _ in cases for l in ls]), indent=1), encoding="utf-8")
    ensure_layer_seconds(path, cases)
    return Machine.load(path)


def step(args: argparse.Namespace) -> Rows:
    """Step time per grid (serial, spatial 2, data 2, weak spatial 2), measured and predicted."""
    from parallel.bench.ranks import run_ranks
    from parallel.bench.step import step_times
    from parallel.plan import Options, build_model, predict, trace

    size = _sizes(args.size)
    split = tuple(_sizes(args.spatial))
    if math.prod(split) != 2:
        raise SystemExit(f"--spatial {args.spatial}: the step benchmark compares 2-way splits")
    summary: dict[str, Any] = {"kind": "summary", "command": "step", "spatial": list(split), "load_before": load()}
    plotted: dict[str, tuple[dict[str, float], dict[str, float]]] = {}
    for name in args.models.split(","):
        over = args.cosmoflow_set if name == "cosmoflow" else args.unet3d_set
        weak = None if args.no_weak else [n * s for n, s in zip(size, split)]
        r = run_ranks(2, step_times, name, size, over, args.batch, args.trials, weak, args.overlap,
                      spatial=split)[0]
        model, in_shape, stored = build_model(name, size, over)
        layers = trace(model, in_shape)
        opts = Options(global_batch=args.batch, stored_bytes_per_voxel=stored, overlap=args.overlap)
        grids = {"serial": (1, (1, 1, 1), layers), "spatial2": (1, split, layers),
                 "data2": (2, (1, 1, 1), layers)}
        if weak is not None:
            wmodel, win, _ = build_model(name, weak, over)
            grids["spatial2_weak"] = (1, split, trace(wmodel, win))
        # Each layer's local computation is timed in isolation (one process, no communication);
        # the model adds the exchanges, the gradient all-reduce and the optimiser.
        machine = _machine(args, [(ls, sp, math.ceil(args.batch / d)) for d, sp, ls in grids.values()])
        predicted = {k: predict(ls, machine, d, sp, opts)["step_s"] for k, (d, sp, ls) in grids.items()}
        # Calibration keeps the least disturbed trial, so predictions compare with the best step.
        error = {k: predicted[k] / r["best_seconds"][k] - 1 for k in r["best_seconds"] if k in predicted}
        yield {"kind": "step", "model": name, "size": size, "batch": args.batch, "set": over,
               "measured_median_s": r["seconds"], "measured_best_s": r["best_seconds"], "predicted_s": predicted,
               "prediction_error": error, **{k: v for k, v in r.items() if k not in ("seconds", "best_seconds")}}
        summary[f"{name}_spatial2_over_serial"] = r["strong_ratio_spatial2"]
        summary[f"{name}_spatial2_over_serial_best"] = r["best_seconds"]["spatial2"] / r["best_seconds"]["serial"]
        if "strong_ratio_data2" in r:
            summary[f"{name}_data2_over_serial"] = r["strong_ratio_data2"]
        if "weak_efficiency_spatial2" in r:
            summary[f"{name}_weak_efficiency_spatial2"] = r["weak_efficiency_spatial2"]
        summary[f"{name}_worst_prediction_error"] = max(abs(e) for e in error.values())
        plotted[name] = (r["best_seconds"], predicted)

    def draw(ax: Any) -> None:
        labels, measured, model = [], [], []
        for name, (best, pred) in plotted.items():
            for grid in best:
                labels.append(f"{name}\n{grid}")
                measured.append(best[grid])
                model.append(pred.get(grid, 0.0))
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], measured, 0.4, label="measured (best trial)")
        ax.bar([x + 0.2 for x in xs], model, 0.4, label="parallel.plan")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("seconds per step")
        ax.set_title(f"step time, {'x'.join(map(str, size))}, global batch {args.batch}")
        ax.legend()

    summary["plot"] = _plot(args, "step", draw)
    summary["load_after"] = load()
    yield summary


# -- memory -----------------------------------------------------------------------------

def _memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="cosmoflow")
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--splits", default="1x1x1,2x1x1,4x1x1")
    p.add_argument("--batch", type=int, default=2, help="samples per step (at 1, the replicated weights, "
                                                         "gradients and momentum are a third of a 4-way rank's peak)")
    p.add_argument("--set", nargs="*", default=[])
    p.add_argument("--recompute", action="store_true", help="also measure with activation checkpointing")
    p.add_argument("--overlap", action="store_true", help="hide the halo exchanges behind the interior")
    p.add_argument("--mmap-threshold", type=int, default=1 << 20,
                   help="glibc MALLOC_MMAP_THRESHOLD_ of the ranks: blocks this large are returned to the "
                        "system when freed, so peak RSS measures live tensors, not heap fragmentation (0: glibc's "
                        "dynamic default)")


def memory(args: argparse.Namespace) -> Rows:
    """Peak memory per rank for one step at each grid, beyond the fixed baseline, vs serial."""
    from parallel.bench.ranks import run_ranks
    from parallel.bench.step import peak_memory
    from parallel.plan import Machine, Options, build_model, predict, trace

    import os

    if args.mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)  # read by the spawned ranks' libc
    model, in_shape, stored = build_model(args.model, (args.size,) * 3, args.set)
    layers = trace(model, in_shape)
    summary: dict[str, Any] = {"kind": "summary", "command": "memory", "load_before": load(),
                               "malloc_mmap_threshold": args.mmap_threshold}
    serial: dict[bool, float] = {}
    plotted: dict[str, list[tuple[int, float]]] = {}
    machine = Machine.load(None)
    for recompute in ([False, True] if args.recompute else [False]):
        for text in args.splits.split(","):
            spatial = _sizes(text)
            world = math.prod(spatial)
            t0 = time.perf_counter()
            ranks = run_ranks(world, peak_memory, args.model, (args.size,) * 3, args.set, args.batch, recompute,
                              args.overlap, spatial=spatial)
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
            plotted.setdefault("recompute" if recompute else "plain", []).append((world, above / 2**20))

    def draw(ax: Any) -> None:
        for label, pts in plotted.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("spatial ranks")
        ax.set_ylabel("peak MiB per rank above baseline")
        ax.set_title(f"{args.model} {args.size}^3, one step")
        ax.legend()

    summary["plot"] = _plot(args, "memory", draw)
    summary["load_after"] = load()
    yield summary


# -- io ---------------------------------------------------------------------------------

def _io_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--spatial", default="2,4,2x2x1")
    p.add_argument("--codecs", default="none,gzip,lz4,zstd,blosc2")
    p.add_argument("--repeat", type=int, default=2)


def _raw_read(files: list[Path], repeat: int) -> float:
    """Best seconds to read the files' bytes sequentially (no HDF5, no decoding)."""
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        for f in files:
            with open(f, "rb") as fh:
                while fh.read(4 << 20):
                    pass
        best = min(best, time.perf_counter() - t0)
    return best


def io(args: argparse.Namespace) -> Rows:
    """Bytes and MB/s per rank: block reads vs whole-sample reads vs a raw sequential read."""
    import importlib.util

    from cosmoflow import synthetic
    from cosmoflow.fields import SPEC
    from parallel.data import parse_splits, write_samples
    from parallel.grid import Grid

    spec = importlib.util.spec_from_file_location(
        "benchmark_io", Path(__file__).resolve().parents[2] / "scripts" / "benchmark_io.py")
    bio = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(bio)  # type: ignore[union-attr]
    splits = parse_splits(args.spatial)
    samples = [synthetic.sample(0, 0, i, args.size) for i in range(args.samples)]
    summary: dict[str, Any] = {"kind": "summary", "command": "io", "load_before": load()}
    speedups: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for codec in args.codecs.split(","):
            d = Path(tmp) / codec.replace(":", "_")
            d.mkdir()
            files = [write_samples(d / f"s{i}.h5", SPEC, {"volume": v[None], "target": t[None]}, splits, codec)
                     for i, (v, t) in enumerate(samples)]
            stored = sum(f.stat().st_size for f in files)
            raw_s = _raw_read(files, args.repeat)
            whole = bio._pattern(files, None, args.repeat)
            row: dict[str, Any] = {"kind": "io", "codec": codec, "size": args.size,
                                   "file_bytes_per_sample": stored / args.samples,
                                   "raw_read_MBps": stored / raw_s / 1e6, "whole": whole, "blocks": {}}
            for spatial in splits:
                s = math.prod(spatial)
                ranks = [bio._pattern(files, Grid(spatial=spatial, world_size=s, rank=r), args.repeat)
                         for r in range(s)]
                worst = max(ranks, key=lambda r: r["seconds_per_sample"])
                key = "x".join(map(str, spatial))
                row["blocks"][key] = {
                    "bytes_read_per_rank_per_sample": max(r["bytes_read_per_sample"] for r in ranks),
                    "share_of_whole_bytes": max(r["bytes_read_per_sample"] for r in ranks)
                    / whole["bytes_read_per_sample"],
                    "rank_stored_MBps": worst["stored_MBps"],
                    "speedup_over_whole": whole["seconds_per_sample"] / worst["seconds_per_sample"],
                }
                summary[f"{codec}_{key}_bytes_share"] = row["blocks"][key]["share_of_whole_bytes"]
                summary[f"{codec}_{key}_speedup"] = row["blocks"][key]["speedup_over_whole"]
            summary[f"{codec}_whole_over_raw_throughput"] = whole["stored_MBps"] / row["raw_read_MBps"]
            speedups[codec] = {k: v["speedup_over_whole"] for k, v in row["blocks"].items()}
            yield row

    def draw(ax: Any) -> None:
        grids = list(next(iter(speedups.values())).keys()) if speedups else []
        width = 0.8 / max(len(speedups), 1)
        for i, (codec, by_grid) in enumerate(speedups.items()):
            ax.bar([g + i * width for g in range(len(grids))], [by_grid[k] for k in grids], width, label=codec)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(grids))], grids)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xlabel("spatial split")
        ax.set_ylabel("per-rank read speedup over whole samples")
        ax.set_title(f"block reads, {args.size}^3")
        ax.legend(fontsize=7)

    summary["plot"] = _plot(args, "io", draw)
    summary["load_after"] = load()
    yield summary


# -- loader -----------------------------------------------------------------------------

def _loader_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--codecs", default="none,zstd")
    p.add_argument("--workers", default="0,1")
    p.add_argument("--set", nargs="*", default=["model.conv_filters=16"], help="CosmoFlow overrides")


def loader(args: argparse.Namespace) -> Rows:
    """Share of the step time spent waiting for data (CosmoFlow, serial and spatial 2)."""
    from cosmoflow import synthetic
    from cosmoflow.fields import SPEC
    from parallel.bench.ranks import run_ranks
    from parallel.bench.step import loader_share
    from parallel.data import write_samples

    summary: dict[str, Any] = {"kind": "summary", "command": "loader", "load_before": load()}
    with tempfile.TemporaryDirectory() as tmp:
        for codec in args.codecs.split(","):
            d = Path(tmp) / codec.replace(":", "_")
            d.mkdir()
            files = [str(write_samples(d / f"s{i}.h5", SPEC, {"volume": v[None], "target": t[None]},
                                       [(1, 1, 1), (2, 1, 1)], codec))
                     for i, (v, t) in enumerate(synthetic.sample(0, 0, i, args.size) for i in range(args.samples))]
            for workers in (int(w) for w in args.workers.split(",")):
                for spatial in ((1, 1, 1), (2, 1, 1)):
                    world = math.prod(spatial)
                    r = run_ranks(world, loader_share, files, "cosmoflow", args.size, args.set, args.batch,
                                  workers, args.steps, spatial=spatial)
                    share = max(x["wait_share"] for x in r)
                    yield {"kind": "loader", "codec": codec, "workers": workers, "spatial": list(spatial),
                           "seconds_per_step": max(x["seconds"] for x in r) / max(r[0]["steps"], 1),
                           "wait_share": share}
                    summary[f"{codec}_workers{workers}_spatial{world}_wait_share"] = share
    summary["load_after"] = load()
    yield summary


# -- calibrate ---------------------------------------------------------------------------

def _calibrate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="cosmoflow")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--set", nargs="*", default=[])
    p.add_argument("--calibration", default=None, help="where to write (default: parallel.plan's file)")
    p.add_argument("--layer-splits", default="1x1x1,2x1x1,1x1x2",
                   help="spatial splits whose per-layer local times to measure ('' for none)")
    p.add_argument("--layer-batches", default="1,2", help="local batches whose per-layer times to measure")


def calibrate(args: argparse.Namespace) -> Rows:
    """Measure this machine for parallel.plan (conv throughput per shape, network, overheads)."""
    from parallel.bench.calibrate import calibrate as measure
    from parallel.plan import DEFAULT_CALIBRATION, build_model, trace

    layers, cases = [], []
    for name, over in (("cosmoflow", args.set), ("unet3d", ["model.depth=3", "model.base_filters=8"])):
        model, in_shape, _ = build_model(name, (args.size,) * 3, over)
        traced = trace(model, in_shape)
        layers += traced
        cases += [(traced, _sizes(g), int(b)) for g in args.layer_splits.split(",") if g
                  for b in args.layer_batches.split(",")]
    result = measure(layers, cases=cases)
    path = Path(args.calibration) if args.calibration else DEFAULT_CALIBRATION
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1), encoding="utf-8")
    yield {"kind": "calibration", "path": str(path), **result, "load": load()}


COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], Rows]]] = {
    "layer": (_layer_args, layer),
    "step": (_step_args, step),
    "memory": (_memory_args, memory),
    "io": (_io_args, io),
    "loader": (_loader_args, loader),
    "calibrate": (_calibrate_args, calibrate),
}
