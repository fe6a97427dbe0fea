"""Whether the network fits the volumes it will see, and the split: checked on the meta
device (``parallel.model.trace``: shapes only, no memory, no compute), before anything
is read.

A split may hold samples of different (D, H, W) (real CT cases do). What the network
sees is then not the case but:

- in training, the crop (``data.crop``), or each whole case when there is no crop;
- in evaluation, the sliding window (``eval.window``, default the crop) over each case's
  kept part (``eval.mode=sliding``), or each whole case (``eval.mode=whole``).

``meta_trace`` is the one trace of the network at a volume, for crops, windows and whole
cases alike: the model's own checks of its volume, and a norm layer left with one value
per channel, name the layer. ``check_cases`` (every rank, with every case's shape
gathered by ``checks.samples``) checks each of those volumes: the model's own checks
(the U-Net wants multiples of its total stride), and for a spatial split that every
strided layer's input is cut at multiples of its stride (the layers' condition for a
split), that each split dim keeps a voxel per block, and that the reference's
evaluation keeps something of each case. ``check_volume`` (before any process group)
checks the training volume and a network of the user's against the family's fields;
``check_model`` checks the training volume against the split: batch norm against the
samples per rank, random draws, and every layer's input and output along a split dim
against its blocks.
Problems name the key or file and the sizes; ``InputError`` ends the job with exit 2.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from typing import Any, Sequence

import torch

from parallel.grid import Grid
from parallel.job.config import JobConfig
from parallel.job.errors import InputError, quote_problems
from parallel.job.family import Family
from parallel.job.usermodel import check_user_model, is_user_model
from parallel.model.random_draws import check_model as check_random_draws
from parallel.model.trace import Layer, hooked, is_leaf, trace
from parallel.partition import DIM_NAMES, SplitError, block_bounds
from parallel.train.checks.config import Shape, train_volume, window

log = logging.getLogger("parallel.train")

Cases = Sequence[tuple[str, Shape]]


class VolumeRefused(InputError):
    """The model's own check of its config against the volume refused to build it (the
    message is the model's)."""


def meta_model(family: Family, model_cfg: Any, volume: Sequence[int]) -> torch.nn.Module:
    """The serial network for ``volume``, built on the meta device; ``VolumeRefused`` when
    the model's own checks refuse the volume."""
    try:
        with torch.device("meta"):
            return family.build_model(model_cfg, tuple(int(v) for v in volume))
    except (ValueError, TypeError) as err:
        raise VolumeRefused(str(err)) from err


def meta_trace(family: Family, model_cfg: Any, volume: Sequence[int], channels: int,
               local_batch: int | None = None, model: torch.nn.Module | None = None) -> list[Layer] | None:
    """The network's leaf layers traced at one sample of ``volume`` on the meta device, or
    None when the meta device cannot run it (the first step will tell).

    Raises ``VolumeRefused`` (the model's own check), or ``InputError`` naming the layer: a
    norm layer left with one value per channel (``local_batch``: samples per rank, for
    batch norm; None leaves batch norm to evaluation's rules), a layer that cannot take
    its input. ``model``: the network already built for ``volume``.
    """
    if model is None:
        model = meta_model(family, model_cfg, volume)
    where = f"a volume of {list(volume)}"
    entered: list[tuple[str, torch.nn.Module, tuple[int, ...]]] = []
    model.eval()  # a batch of one on the tracer: batch norm's own check is the pre-hook's, per rank's batch
    try:
        with hooked(model, _norm_check(where, local_batch, entered), is_leaf, pre=True):
            return trace(model, (channels, *volume))
    except InputError:
        raise
    except (NotImplementedError, RuntimeError, ValueError) as err:
        if isinstance(err, NotImplementedError) or "meta" in str(err).lower():
            log.debug("shape check skipped: the model does not run on the meta device (%s)", err)
            return None
        if entered:
            name, module, shape = entered[-1]
            raise InputError(f"layer '{name}' ({type(module).__name__}) cannot take its input of "
                             f"{'x'.join(map(str, shape))} voxels (C x D x H x W, per sample) at {where}: "
                             f"{str(err).splitlines()[0]}; use a larger volume or a shallower model") from err
        raise InputError(f"the model ({family.name}, model config {model_cfg}) cannot run on {where}: {err}") from err


def check_volume(family: Family, model_cfg: Any, volume: Sequence[int], channels: int) -> None:
    """Before any process group: ``InputError`` when the network cannot run at the volume it
    trains on (the model's own checks, a layer that cannot take its input, a norm layer left
    with one voxel per channel), or a network of the user's does not fit the family's
    fields (its input channels, its output against the target)."""
    try:
        model = meta_model(family, model_cfg, volume)
    except VolumeRefused as err:  # the model's own checks of its config against the volume
        raise InputError(f"{family.name} model: {err}") from err
    if is_user_model(model_cfg):  # a network of the user's: does it fit the family's fields?
        try:
            check_user_model(model, family, model_cfg, volume, channels)
        except ValueError as err:
            raise InputError(str(err)) from err
    meta_trace(family, model_cfg, volume, channels, model=model)


def check_model(family: Family, model_cfg: Any, volume: Sequence[int], channels: int, grid: Grid,
                local_batch: int | None = None) -> None:
    """Raise ``InputError`` for a model/volume/split mismatch that would fail the first step,
    naming the layer and the sizes: a norm layer left with one voxel per channel
    (InstanceNorm on a 1x1x1 bottleneck; BatchNorm also with ``local_batch`` samples per
    rank), a kernel or stride beyond what reaches the layer, random draws shaped like the
    split volume, and a layer's input or output along a split dim with fewer voxels than
    blocks.
    """
    try:
        model = meta_model(family, model_cfg, volume)
    except VolumeRefused as err:  # the model's own checks of its config against the volume
        raise InputError(f"{family.name} model: {err}") from err
    layers = meta_trace(family, model_cfg, volume, channels, max(1, local_batch) if local_batch else None,
                        model=model)
    if layers is None or grid.spatial_size == 1:
        return
    check_random_draws(model, (channels, *volume), grid.spatial, InputError)  # noise shaped like the split volume
    for layer in layers:
        if layer.replicated or len(layer.in_shape) != 4 or len(layer.out_shape) != 4:
            continue  # after a global pool every rank holds the whole tensor
        n_in, n_out = layer.in_shape[1:], layer.out_shape[1:]
        n_out = n_in if layer.out_replicated else n_out
        for axis, parts in enumerate(grid.spatial):
            if parts > 1 and min(n_in[axis], n_out[axis]) < parts:
                raise InputError(
                    f"layer '{layer.name}' ({type(layer.module).__name__}): output size {n_out[axis]} along dim "
                    f"{DIM_NAMES[axis]} (input {n_in[axis]}) cannot be split {parts} ways for "
                    f"parallel.spatial={list(grid.spatial)} and a volume of {list(volume)}; use fewer "
                    f"blocks along {DIM_NAMES[axis]}, a larger volume or a shallower model")


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
            layers = meta_trace(self.family, self.model_cfg, volume, self.channels)
        except InputError as err:  # the model's own checks of its volume, a layer that cannot run
            return [f"{what}: {err}"]
        if layers is None:
            return []  # a model the meta device cannot run: the first step will tell
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


def check_cases(cfg: JobConfig, family: Family, grid: Grid, channels: int, train: Cases, val: Cases) -> None:
    """Check every case of both splits against what the job's network needs (see the module
    docstring); ``InputError`` quoting the first problems. ``train``/``val``: (file, (D, H, W))."""
    strides = Strides(family, cfg.model, channels, grid)
    problems: list[str] = []
    crop = cfg.data.crop
    if crop is not None:
        problems += strides.problems(train_volume(crop, crop), f"data.crop={list(crop)}")
        if cfg.data.oversampling > 0 and not family.crop_boxes:
            problems.append(f"data.oversampling={cfg.data.oversampling}: {family.name}'s sample files store no "
                            "foreground boxes to place crops around; set data.oversampling=0 (uniform crops)")
    else:
        shapes = distinct(train)
        for shape, paths in shapes.items():
            problems += strides.problems(shape, _files(paths, shape))
        per_group = cfg.train.global_batch_size // max(grid.data_size * cfg.train.accum_steps, 1)
        if len(shapes) > 1 and per_group > 1:
            shown = ", ".join(_files(p, s) for s, p in list(shapes.items())[:3])
            problems.append(f"the training cases differ in shape ({shown}, ...): {per_group} per data group and "
                            "step cannot be stacked; set data.crop=[D,H,W] (training crops), or "
                            "train.global_batch_size = data groups x train.accum_steps (one case each)")
    if str(cfg.eval.mode) == "sliding":
        problems += _sliding(cfg, grid, strides, val)
    else:
        for shape, paths in distinct(val).items():
            problems += strides.problems(shape, f"{_files(paths, shape)} (eval.mode=whole)")
    if problems:
        raise InputError(quote_problems("case(s) or setting(s) the network cannot run", problems))


def _sliding(cfg: JobConfig, grid: Grid, strides: Strides, val: Cases) -> list[str]:
    from parallel.infer.windows import kept_range

    w = window(cfg.eval, cfg.data.crop)
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


def _norm_check(where: str, local_batch: int | None, entered: list) -> Any:
    """A forward pre-hook (``hooked``) that notes the layer entered and refuses a norm layer
    whose statistics would span one value per channel (torch raises at the first training step)."""

    def hook(name: str, module: torch.nn.Module, args: tuple) -> None:
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is None:
            return
        entered.append((name, module, tuple(x.shape[1:])))
        voxels = math.prod(x.shape[2:]) if x.dim() > 2 else 1
        size = "x".join(map(str, x.shape[2:])) or "1"
        kind = type(module).__name__
        if isinstance(module, torch.nn.modules.instancenorm._InstanceNorm) and voxels <= 1:
            raise InputError(f"layer '{name}' ({kind}) normalises each channel over its {size} voxel(s) at {where}: "
                             "instance norm needs more than one (torch: 'Expected more than 1 spatial element "
                             "when training'); use a larger volume (or data.crop) or a shallower model")
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and local_batch is not None \
                and voxels * local_batch <= 1:
            raise InputError(f"layer '{name}' ({kind}) normalises each channel over {size} voxel(s) x {local_batch} "
                             f"sample(s) per rank at {where}: batch norm needs more than one value (torch: 'Expected "
                             "more than 1 value per channel when training'); use a larger volume, a larger "
                             "train.global_batch_size per data group, or another model.norm")

    return hook
