"""The split layers against their peers on one harness (``scripts/benchmark.py peers``).

Per case (an operator, kernel, stride, channels, cube edge and split), every contestant
runs forward and backward on the same rank's block, interleaved trial by trial
(``parallel.bench.timing.interleaved``): this project's split layer as a user runs it
(``parallelize(..., conv_path="auto")``, its gradient all-reduce included), the plain block convolution (the
rank's block with its halo already in place and no communication: the floor), and each
peer that imports: PhysicsNeMo's ``ShardTensor`` and LBANN DistConv's ``DCTensor`` (under
its ``DistConvDDP``, whose all-reduce is the counterpart of ours). Peers are not
dependencies: docs/performance.md ("Peers") says how to install them. A peer that is
absent, lacks the operator, raises, or returns other numbers than the project's layer
(itself proven against ``torch.nn`` by the tests) is skipped and the reason reported.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import parallel
from parallel.bench.peer_step import StepCase, parse_step
from parallel.bench.shared import Rows, agree, failure
from parallel.bench.timing import interleaved, load, median, ratio
from parallel.grid import Grid
from parallel.layers.conv.kernels import conv3d

log = logging.getLogger(__name__)

SPLITS = {"D": (2, 1, 1), "W": (1, 1, 2), "DH": (2, 2, 1)}
PEERS = ("shardtensor", "distconv")
SUPPORTS = {"shardtensor": ("conv", "convT", "maxpool"), "distconv": ("conv",)}
"""What each peer parallelises: ShardTensor has convolutions (transposed only with
kernel = stride, no padding), pooling; DistConv convolutions only."""
IMPORTS = {"shardtensor": "physicsnemo.domain_parallel", "distconv": "distconv"}


@dataclass(frozen=True)
class Case:
    """One layer on one grid: ``conv`` (padding k // 2), ``convT`` or ``maxpool``."""

    op: str
    kernel: int
    stride: int
    split: str
    channels: int
    size: int

    @property
    def id(self) -> str:
        return f"{self.op}-k{self.kernel}-s{self.stride}-{self.split}-c{self.channels}-n{self.size}"

    @property
    def spatial(self) -> tuple[int, int, int]:
        return SPLITS[self.split]  # type: ignore[return-value]


def parse_case(text: str) -> Case:
    """``conv-k3-s1-D-c32-n64`` -> Case; a clear error naming the part that is wrong."""
    parts = text.split("-")
    try:
        op, k, s, split, c, n = parts
        if op not in ("conv", "convT", "maxpool") or split not in SPLITS:
            raise ValueError
        return Case(op, int(k.removeprefix("k")), int(s.removeprefix("s")), split, int(c.removeprefix("c")),
                    int(n.removeprefix("n")))
    except ValueError:
        raise ValueError(f"peers case {text!r}: expected OP-kK-sS-SPLIT-cC-nN with OP in conv, convT, maxpool "
                         f"and SPLIT in {', '.join(SPLITS)} (e.g. conv-k3-s1-D-c32-n64)") from None


QUICK = [Case("conv", 3, 1, "D", 32, 64), Case("conv", 3, 1, "W", 32, 64), Case("conv", 3, 2, "D", 32, 64),
         Case("conv", 5, 1, "D", 32, 64), Case("conv", 3, 1, "DH", 32, 64)]
FULL = [Case("conv", k, s, sp, c, n) for n in (64, 128) for c in (32, 64) for sp in SPLITS
        for k in (3, 5) for s in (1, 2)]
FULL += [Case("convT", 2, 2, sp, 32, n) for n in (64, 128) for sp in SPLITS]
FULL += [Case("maxpool", 2, 2, sp, 32, n) for n in (64, 128) for sp in SPLITS]
STEPS = [StepCase("D", 64), StepCase("W", 64)]
"""The whole CosmoFlow step against DistConv's (``parallel.bench.peer_step``): in the full set."""


def peer_status() -> dict[str, str | None]:
    """Per peer: None where it imports here, else why not (the import error)."""
    out: dict[str, str | None] = {}
    for name in PEERS:
        try:
            importlib.import_module(IMPORTS[name])
            out[name] = None
        except Exception as err:  # noqa: BLE001 - any import failure means absent
            out[name] = f"{type(err).__name__}: {err}"
    return out


def _layer(case: Case) -> nn.Module:
    c, k, s = case.channels, case.kernel, case.stride
    if case.op == "conv":
        return nn.Conv3d(c, c, k, s, padding=k // 2)
    if case.op == "convT":
        return nn.ConvTranspose3d(c, c, k, s)
    return nn.MaxPool3d(k, s)


def _block_runs(case: Case, grid: Grid, layer: nn.Module, x: torch.Tensor,
                timed: Callable[..., dict[str, float]]) -> dict[str, Callable[[], dict[str, float]]]:
    """The floor: the rank's block with its halo in place (zeros: the values do not change
    the time), no communication; torch's kernel choice and the split layer's (reordered
    thin blocks), the faster per trial counting."""
    if case.op != "conv":
        fn = (lambda t: F.conv_transpose3d(t, layer.weight, layer.bias, case.stride)) if case.op == "convT" \
            else (lambda t: F.max_pool3d(t, case.kernel, case.stride))
        return {"block": lambda: timed(x, fn)}
    halo = [case.kernel // 2 if p > 1 else 0 for p in grid.spatial]
    window = F.pad(x.detach(), [h for h in reversed(halo) for _ in (0, 1)]).requires_grad_(True)
    pads = [0 if h else case.kernel // 2 for h in halo]
    w, b, s = layer.weight, layer.bias, [case.stride] * 3
    return {"block_torch": lambda: timed(window, lambda t: F.conv3d(t, w, b, s, pads)),
            "block_reordered": lambda: timed(window, lambda t: conv3d(t, w, b, s, pads, [1] * 3, 1))}


def _shardtensor(case: Case, grid: Grid, layer: nn.Module, shape: tuple[int, ...]) -> Callable[..., Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from physicsnemo.domain_parallel import ShardTensor

    axes = [a for a in range(3) if grid.spatial[a] > 1]
    mesh = init_device_mesh("cpu", tuple(grid.spatial[a] for a in axes))
    placements = [Shard(a + 2) for a in axes]

    def run(x: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], None]]:
        st = ShardTensor.from_local(x, mesh, placements, sharding_shapes="chunk", global_shape=torch.Size(shape))
        y = layer(st).to_local()
        return y, y.backward
    return run


def _distconv(case: Case, grid: Grid, layer: nn.Module, shape: tuple[int, ...]) -> Callable[..., Any]:
    from distconv import DCTensor, DistConvDDP, ParallelStrategy

    axes = [a for a in range(3) if grid.spatial[a] > 1]
    ps = ParallelStrategy(num_shards=tuple(grid.spatial[a] for a in axes), shard_dim=tuple(a + 2 for a in axes),
                          device_type="cpu")
    model = DistConvDDP(layer, parallel_strategy=ps)

    def run(x: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], None]]:
        y = model(DCTensor.from_shard(x, ps))
        return y._tensor, lambda g: y.backward(DCTensor(g, ps))
    return run


def time_case(grid: Grid, case: Case, trials: int, peers: tuple[str, ...], paths: tuple[str, ...]) -> dict[str, Any]:
    """Seconds per trial (forward and backward apart) of every contestant on this rank's
    block, their ratios, and why any peer was skipped."""
    torch.manual_seed(0)
    layer = _layer(case)
    shape = (1, case.channels, case.size, case.size, case.size)
    local = tuple(b - a for a, b in grid.block_range(shape[2:]))
    x = torch.randn(1, case.channels, *local, requires_grad=True)
    pmodel = parallel.parallelize(copy.deepcopy(layer), grid, conv_path="auto")
    ref = pmodel(x).detach()
    g = torch.randn_like(ref)

    def timed(inp: torch.Tensor, fn: Callable[[torch.Tensor], Any],
              backward: Callable[[Any, torch.Tensor], None] | None = None) -> dict[str, float]:
        inp.grad = None
        t0 = time.perf_counter()
        y = fn(inp)
        t1 = time.perf_counter()
        if backward is None:
            y.backward(g)
        else:
            backward(y, g)
        return {"forward": t1 - t0, "backward": time.perf_counter() - t1}

    runs: dict[str, Callable[[], dict[str, float]]] = {}
    projects = {"project": pmodel}
    for path in paths if case.op == "conv" else ():  # the conv's paths forced, for comparison
        projects[f"project_{path}"] = parallel.parallelize(copy.deepcopy(layer), grid, conv_path=path)
    for name, pm in projects.items():
        runs[name] = (lambda pm: lambda: timed(x, pm))(pm)
    runs.update(_block_runs(case, grid, layer, x, timed))
    skipped: dict[str, str] = {}
    for name in peers:
        if case.op not in SUPPORTS[name]:
            skipped[name] = f"has no {case.op}"
            continue
        reason = ""
        try:
            run = (_shardtensor if name == "shardtensor" else _distconv)(case, grid, copy.deepcopy(layer), shape)
            xp = x.detach().clone().requires_grad_(True)
            y, back = run(xp)
            back(g)
            err = float((y.detach() - ref).abs().max())
            if err > 1e-4 * max(1.0, float(ref.abs().max())):
                reason = f"output differs from the project's by {err:.3g}"
        except Exception as e:  # noqa: BLE001 - a peer that fails here is reported, not fatal
            reason = failure(e)
        if not agree(not reason, grid.spatial_group):
            skipped[name] = reason or "failed on another rank"
            continue
        runs[name] = (lambda r, xp: lambda: timed(xp, r, lambda yb, gg: yb[1](gg)))(run, xp)
    times = interleaved(runs, trials, warmup=1, group=grid.spatial_group, cpu=True)
    for key in ("", ".forward", ".backward", ".cpu"):
        blocks = [times[k + key] for k in ("block_torch", "block_reordered", "block") if k + key in times]
        times["best_block" + key] = [min(v) for v in zip(*blocks)]
    timed_peers = [p for p in peers if p in runs]
    chosen = [m.path_chosen for m in pmodel.modules() if getattr(m, "path_chosen", None)]
    out: dict[str, Any] = {"local_block": list(local), "skipped": skipped, "peers": timed_peers,
                           "project_path": chosen[0] if chosen else None,
                           "project_path_seconds": next((m.__dict__["path_seconds"] for m in pmodel.modules()
                                                         if "path_seconds" in m.__dict__), None),
                           "seconds": {k: median(v) for k, v in times.items() if "." not in k},
                           "over_block": {k: ratio(times[k], times["best_block"]) for k in (*projects, *timed_peers)}}
    out["backward_over_block"] = {k: ratio(times[k + ".backward"], times["best_block.backward"])
                                  for k in (*projects, *timed_peers)}
    # CPU seconds of the process (all its threads): steadier on a shared machine, blind to
    # time spent waiting for messages; beside the wall-clock ratios, not instead of them.
    out["cpu_over_block"] = {k: ratio(times[k + ".cpu"], times["best_block.cpu"]) for k in (*projects, *timed_peers)}
    if timed_peers:
        best = [min(v) for v in zip(*(times[p] for p in timed_peers))]
        out["over_best_peer"] = {k: ratio(times[k], best) for k in projects}
        best = [min(v) for v in zip(*(times[p + ".cpu"] for p in timed_peers))]
        out["cpu_over_best_peer"] = {k: ratio(times[k + ".cpu"], best) for k in projects}
    return out


def time_cases(grid: Grid, cases: list[Case], trials: int, peers: tuple[str, ...],
               paths: tuple[str, ...]) -> list[dict[str, Any]]:
    """``time_case`` for each case of one split, in one set of ranks."""
    return [time_case(grid, c, trials, peers, paths) for c in cases]


# -- the subcommand ---------------------------------------------------------------------

def command_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help=f"the {len(QUICK)} quick cases (minutes on 2 cores)")
    p.add_argument("--cases", default=None, help="comma list of case ids, e.g. conv-k3-s1-D-c32-n64 "
                   "or step-cosmoflow-D-n64 (the whole training step; default: the full set, or --quick's)")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--paths", default="shell,window", help="also time the split conv with its path forced "
                   "(comma list of shell, window; empty: none)")
    p.add_argument("--peers", default=",".join(PEERS), help="the peers to try (absent ones are skipped)")
    p.add_argument("--channels-last", action="store_true", help="step cases: also time serial, project, DistConv "
                   "and floor with NDHWC activations (parallel.channels_last), each over the serial of its layout")


def _table(rows: list[dict[str, Any]], absent: dict[str, str]) -> list[str]:
    lines = [f"{'case':28} {'project/best peer':>18} {'(cpu)':>6} {'project/block':>14} {'(cpu)':>6} " +
             " ".join(f"{p + '/block':>17}" for p in PEERS)]
    for r in rows:
        if r["case"].startswith("step-"):
            serial = " ".join(f"{k}/serial {v:.3f}" for k, v in r["over_serial"].items())
            best = r.get("over_best_peer", {}).get("project")
            lines.append(f"{r['case']:28} {'-' if best is None else round(best, 3)!s:>18}   {serial}")
            lines += [f"    {p}: skipped ({why})" for p, why in r["skipped"].items() if p not in absent]
            continue
        best = [r.get(k, {}).get("project") for k in ("over_best_peer", "cpu_over_best_peer")]
        best_text = [f"{'-' if b is None else round(b, 3)!s}" for b in best]
        peers = " ".join(f"{r['over_block'][p]:17.3f}" if p in r["over_block"] else f"{'-':>17}" for p in PEERS)
        lines.append(f"{r['case']:28} {best_text[0]:>18} {best_text[1]:>6} {r['over_block']['project']:14.3f} "
                     f"{r['cpu_over_block']['project']:6.3f} {peers}")
        lines += [f"    {p}: skipped ({why})" for p, why in r["skipped"].items() if p not in absent]
    lines += [f"{p}: absent ({why}); skipped" for p, why in absent.items()]
    return lines


def command(args: argparse.Namespace) -> Rows:
    """This project's split layers against the block floor and the importable peers."""
    from parallel.bench.peer_step import time_steps
    from parallel.bench.ranks import run_ranks
    from parallel.bench.shared import plot

    texts = args.cases.split(",") if args.cases else None
    cases = [parse_case(t) for t in texts if not t.startswith("step-")] if texts else (QUICK if args.quick else FULL)
    steps = [parse_step(t) for t in texts if t.startswith("step-")] if texts else ([] if args.quick else STEPS)
    status = peer_status()
    wanted = tuple(p for p in args.peers.split(",") if p)
    unknown = [p for p in wanted if p not in PEERS]
    if unknown:
        raise SystemExit(f"--peers: unknown {unknown}; known: {', '.join(PEERS)}")
    absent = {p: why for p, why in status.items() if p in wanted and why is not None}
    for p, why in absent.items():
        log.warning("peer %s is absent (%s): skipped", p, why)
    present = tuple(p for p in wanted if p not in absent)
    paths = tuple(p for p in args.paths.split(",") if p)
    summary: dict[str, Any] = {"kind": "summary", "command": "peers", "load_before": load(), "absent": absent,
                               "present": list(present)}
    rows: list[dict[str, Any]] = []
    for split in SPLITS:
        mine = [c for c in cases if c.split == split]
        if not mine:
            continue
        results = run_ranks(math.prod(SPLITS[split]), time_cases, mine, args.trials, present, paths,
                            spatial=SPLITS[split], timeout=7200.0)[0]
        for c, r in zip(mine, results):
            row = {"kind": "peers", "case": c.id, **r}
            rows.append(row)
            yield row
    for split in SPLITS:
        mine_steps = [c for c in steps if c.split == split]
        if not mine_steps:
            continue
        step_paths = tuple(p for p in paths if p != "shell")  # the step's default is the shell
        results = run_ranks(2, time_steps, mine_steps, args.trials, present, step_paths, args.channels_last,
                            spatial=mine_steps[0].spatial,
                            timeout=7200.0)[0]
        for c, r in zip(mine_steps, results):
            row = {"kind": "peers", "case": c.id, **r}
            rows.append(row)
            yield row
    for r in rows:
        if r["case"].startswith("step-"):
            summary[f"project_over_serial_{r['case']}"] = r["over_serial"]["project"]
            if "distconv" in r["over_serial"]:
                summary[f"distconv_over_serial_{r['case']}"] = r["over_serial"]["distconv"]
            for k, v in r.get("over_best_peer", {}).items():  # project, project_cl, project_<path>...
                summary[f"{k}_over_best_peer_{r['case']}"] = v
            continue
        summary[f"project_over_block_{r['case']}"] = r["over_block"]["project"]
        if "over_best_peer" in r:
            summary[f"project_over_best_peer_{r['case']}"] = r["over_best_peer"]["project"]
    summary["table"] = _table(rows, absent)

    conv_rows = [r for r in rows if "over_block" in r]

    def draw(ax: Any) -> None:
        rows = conv_rows
        names = ["project", *PEERS]
        for i, name in enumerate(names):
            vals = [r["over_block"].get(name, float("nan")) for r in rows]
            ax.bar([j + 0.25 * i for j in range(len(rows))], vals, width=0.25, label=name)
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_xticks([j + 0.25 for j in range(len(rows))], [r["case"] for r in rows], rotation=60, fontsize=6)
        ax.set_ylabel("forward+backward / block conv")
        ax.legend()

    summary["plot"] = plot(args, "peers", draw)
    if args.plot is not None and summary["plot"] is None:
        summary["plot_missing"] = "matplotlib is not installed: no PNG written"
    summary["load_after"] = load()
    yield summary
