"""Cases of any shape: the volumes a job's model runs at, and the checks of each case.

A split may hold samples of different (D, H, W) (real CT cases do). What the network
sees is then not the case but:

- in training, the crop (``data.crop``), or each whole case when there is no crop;
- in evaluation, the sliding window (``eval.window``, default the crop) over each case's
  kept part (``eval.mode=sliding``), or each whole case (``eval.mode=whole``).

``check`` (run by the preflight on every rank, with every case's shape gathered) checks
each of those volumes against the network, before anything is read: the model's own
checks (the U-Net wants multiples of its total stride), and for a spatial split that
every strided layer's input is cut at multiples of its stride (the layers' condition for
a split), that each split dim keeps a voxel per block, and that the reference's
evaluation keeps something of each case. Problems name the key or file and the sizes;
``InputError`` ends the job with exit 2 and one message.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Sequence

import torch

from parallel.grid import Grid
from parallel.partition import DIM_NAMES, SplitError, block_bounds
from parallel.train.config import JobConfig
from parallel.train.family import Family
from parallel.train.preflight import MAX_LISTED, ConfigError, InputError

Shape = tuple[int, int, int]
Cases = Sequence[tuple[str, Shape]]


def validate(cfg: JobConfig) -> None:
    """``ConfigError`` for crop and evaluation settings that cannot work (no files needed)."""
    crop = cfg.data.crop
    if crop is not None and (len(crop) != 3 or min(int(c) for c in crop) < 1):
        raise ConfigError(f"data.crop={list(crop)}: want three positive sizes [D, H, W] or null")
    if not 0.0 <= cfg.data.oversampling <= 1.0:
        raise ConfigError(f"data.oversampling={cfg.data.oversampling}: a probability, want 0 <= p <= 1")
    ev = cfg.eval
    if ev.window is not None and (len(ev.window) != 3 or min(int(w) for w in ev.window) < 1):
        raise ConfigError(f"eval.window={list(ev.window)}: want three positive sizes [D, H, W] or null")
    if not 0.0 <= ev.overlap < 1.0:
        raise ConfigError(f"eval.overlap={ev.overlap}: want 0 <= overlap < 1")
    if str(ev.mode) == "sliding" and window(cfg) is None:
        raise ConfigError("eval.mode=sliding needs a window: set eval.window=[D,H,W] or data.crop=[D,H,W] "
                          "(the reference's window is the crop), or eval.mode=whole")
    if ev.start_epoch < 0:
        raise ConfigError(f"eval.start_epoch={ev.start_epoch}: want >= 0 (0: every train.eval_every epochs)")
    if str(ev.mode) == "sliding":
        from parallel.infer.windows import plan_windows

        w = window(cfg)
        try:
            plan_windows(w, w, ev.overlap)  # type: ignore[arg-type]
        except ValueError as err:
            raise ConfigError(f"eval.overlap={ev.overlap} with the window {list(w)}: "  # type: ignore[arg-type]
                              f"{err}") from None


def window(cfg: JobConfig) -> Shape | None:
    """The sliding window of the job's evaluation: ``eval.window``, else the crop."""
    w = cfg.eval.window if cfg.eval.window is not None else cfg.data.crop
    return tuple(int(v) for v in w) if w is not None else None  # type: ignore[return-value]


def train_volume(cfg: JobConfig, volume: Sequence[int]) -> Shape:
    """The volume the network trains on: the crop, or the cases' (``volume``: the first case's)."""
    v = cfg.data.crop if cfg.data.crop is not None else volume
    return tuple(int(n) for n in v)  # type: ignore[return-value]


def weights_depend_on_volume(family: Family, model_cfg: Any, volume: Sequence[int]) -> bool:
    """Whether the network's weights change with its input volume (CosmoFlow's dense head:
    it takes one volume, every sample must have it); False where it cannot be told."""
    v = tuple(int(n) for n in volume)
    for pair in ((1, 2), (4, 8), (16, 32)):  # larger volumes where a deep network refuses small ones
        shapes = []
        try:
            for scale in pair:
                with torch.device("meta"):
                    model = family.build_model(model_cfg, tuple(n * scale for n in v))
                shapes.append({k: tuple(t.shape) for k, t in model.state_dict().items()})
        except Exception:  # noqa: BLE001 - a model that cannot be built at these sizes: try larger ones
            continue
        return shapes[0] != shapes[1]
    return False


def distinct(cases: Cases) -> "OrderedDict[Shape, list[str]]":
    """Shapes in first-seen order, each with the files that have it."""
    out: OrderedDict[Shape, list[str]] = OrderedDict()
    for path, shape in cases:
        out.setdefault(tuple(int(n) for n in shape), []).append(path)  # type: ignore[arg-type]
    return out


def _files(paths: list[str], shape: Shape) -> str:
    """The first file of a shape, the shape and how many more files have it."""
    return f"{paths[0]} {list(shape)}" + (f" (and {len(paths) - 1} more of that shape)" if len(paths) > 1 else "")


class Strides:
    """The model's needs at a volume: its own checks, and under a split the alignment of
    every strided layer's input blocks (traced on the meta device: no memory)."""

    def __init__(self, family: Family, model_cfg: Any, channels: int, grid: Grid) -> None:
        self.family, self.model_cfg, self.channels, self.grid = family, model_cfg, channels, grid

    def problems(self, volume: Shape, what: str) -> list[str]:
        """What stops the network at ``volume`` (empty when nothing); ``what`` names it."""
        try:
            with torch.device("meta"):
                model = self.family.build_model(self.model_cfg, volume)
        except (ValueError, TypeError) as err:  # the model's own checks of its volume
            return [f"{what}: {err}"]
        from parallel.plan.trace import trace
        from parallel.train.preflight import InputError, _norm_check

        entered: list = []  # a norm layer left with one voxel is named (preflight's hook)
        hooks = [m.register_forward_pre_hook(_norm_check(name, f"a volume of {list(volume)}", None, entered))
                 for name, m in model.named_modules() if not list(m.children())]
        try:
            layers = trace(model, (self.channels, *volume))
        except InputError as err:
            return [f"{what}: {err}"]
        except ValueError as err:  # torch's own refusal
            return [f"{what}: the network cannot run on {list(volume)}: {err}"]
        except (NotImplementedError, RuntimeError):
            return []  # a model the meta device cannot run: the first step will tell
        finally:
            for h in hooks:
                h.remove()
        if self.grid.spatial_size == 1:
            return []
        strided = [ly for ly in layers if ly.kind in ("conv", "pool") and len(ly.in_shape) == 4]
        for axis, parts in enumerate(self.grid.spatial):
            if parts == 1:
                continue
            total = math.prod(ly.stride[axis] for ly in strided)
            for ly in strided:
                n, s = ly.in_shape[1 + axis], ly.stride[axis]
                try:
                    bounds = block_bounds(n, parts)
                except SplitError:
                    return [f"{what}: layer '{ly.name}' gets {n} voxels along dim {DIM_NAMES[axis]}, fewer "
                            f"than the {parts} blocks of parallel.spatial={list(self.grid.spatial)}"]
                cut = next((b for _, b in bounds[:-1] if b % s), None)
                if s > 1 and cut is not None:
                    blocks = [b - a for a, b in block_bounds(volume[axis], parts)]
                    return [f"{what}: split {parts} ways along dim {DIM_NAMES[axis]} ({volume[axis]} -> blocks "
                            f"{blocks}), layer '{ly.name}' (stride {s}) would cut its {n} input voxels at {cut}, "
                            f"not a multiple of its stride: blocks must be multiples of the network's total "
                            f"stride {total} along {DIM_NAMES[axis]}"]
        return []


def check(cfg: JobConfig, family: Family, grid: Grid, channels: int, train: Cases, val: Cases) -> None:
    """Check every case of both splits against what the job's network needs (see the module
    docstring); ``InputError`` quoting the first problems. ``train``/``val``: (file, (D, H, W))."""
    strides = Strides(family, cfg.model, channels, grid)
    problems: list[str] = []
    crop = cfg.data.crop
    if crop is not None:
        problems += strides.problems(train_volume(cfg, crop), f"data.crop={list(crop)}")
        if cfg.data.oversampling > 0 and not family.crop_boxes:
            problems.append(f"data.oversampling={cfg.data.oversampling}: {family.name}'s sample files store no "
                            "foreground boxes to place crops around; set data.oversampling=0 (uniform crops)")
    else:
        shapes = distinct(train)
        for shape, paths in shapes.items():
            problems += strides.problems(shape, _files(paths, shape))
        per_group = cfg.train.global_batch_size // max(grid.data_size * cfg.train.accum_steps, 1)
        if len(shapes) > 1 and per_group > 1:
            listed = ", ".join(_files(p, s) for s, p in list(shapes.items())[:3])
            problems.append(f"the training cases differ in shape ({listed}, ...): {per_group} per data group and "
                            "step cannot be stacked; set data.crop=[D,H,W] (training crops), or "
                            "train.global_batch_size = data groups x train.accum_steps (one case each)")
    if str(cfg.eval.mode) == "sliding":
        problems += _sliding(cfg, grid, strides, val)
    else:
        for shape, paths in distinct(val).items():
            problems += strides.problems(shape, f"{_files(paths, shape)} (eval.mode=whole)")
    if problems:
        more = f" (and {len(problems) - MAX_LISTED} more)" if len(problems) > MAX_LISTED else ""
        raise InputError(f"{len(problems)} case(s) or setting(s) the network cannot run{more}:\n  "
                         + "\n  ".join(problems[:MAX_LISTED]))


def _sliding(cfg: JobConfig, grid: Grid, strides: Strides, val: Cases) -> list[str]:
    from parallel.infer.windows import kept_range

    w = window(cfg)
    assert w is not None
    key = f"eval.window={list(w)}" if cfg.eval.window is not None else f"the sliding window (data.crop={list(w)})"
    problems = strides.problems(w, key)
    for shape, paths in distinct(val).items():
        try:
            kept = [b - a for a, b in kept_range(shape, w, cfg.eval.overlap)]
        except ValueError as err:
            problems.append(f"{_files(paths, shape)}: {err}")
            continue
        short = [(DIM_NAMES[a], kept[a], p) for a, p in enumerate(grid.spatial) if kept[a] < p]
        if short:
            dim, n, p = short[0]
            problems.append(f"{_files(paths, shape)}: the evaluated part ({kept}) has {n} voxels along "
                            f"dim {dim}, fewer than its {p} blocks (parallel.spatial={list(grid.spatial)})")
    return problems
