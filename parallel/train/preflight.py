"""Checks before training: bad input stops the job with one clear message, up front.

``validate_config`` checks the values Hydra's types cannot (lengths, signs, ranges) and
names the key. ``read_facts`` reads what the job needs to know about its samples (the
volume, the input's channels and stored bytes) once, from the first training file;
everything after is handed these ``SampleFacts``. ``check_data`` (collective) checks
the sample files of the train and val splits, each rank a share of the files
(``parallel.data.check.check_file``: readable HDF5, fields, dtypes, shapes, sample
counts, finite targets; ``data.check=deep`` reads every voxel), and that the grid can
split the volume. ``check_model`` traces the serial model on the meta device
(``parallel.plan.trace``: no memory, no compute) and checks that every activation along
a split dim still has a voxel per block, naming the layer otherwise. Every rank raises
the same ``InputError``, so the job ends cleanly without waiting for a timeout. See
``docs/failures.md``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from parallel import comm

from parallel.data.check import check_file
from parallel.data.format import SampleSpec, read_manifest, sample_files
from parallel.grid import Grid
from parallel.partition import DIM_NAMES, SplitError
from parallel.random_draws import check_model as check_random_draws
from parallel.train.config import JobConfig
from parallel.train.family import Family
from parallel.train.usermodel import check_user_model, is_user_model

log = logging.getLogger("parallel.train")

MAX_LISTED = 8  # problems quoted in the message; the rest are counted


class InputError(ValueError):
    """Bad data, config or model/grid combination, found before training. Raised alike on
    every rank (``collective``), so only rank 0 needs to report it."""

    collective = True


class ConfigError(InputError):
    """A config value that cannot work; the message names the key."""


def is_auto(spatial: Any) -> bool:
    """Whether ``parallel.spatial`` asks the planner to choose (``auto``)."""
    return isinstance(spatial, str) and spatial == "auto"


def validate_config(cfg: JobConfig) -> None:
    """Raise ``ConfigError`` naming the first key whose value cannot work."""
    spatial = cfg.parallel.spatial
    spatial_ok = is_auto(spatial) or isinstance(spatial, (list, tuple)) and len(spatial) == 3 and all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in spatial)
    checks: list[tuple[bool, str]] = [
        (spatial_ok, f"parallel.spatial={spatial}: want three positive ints [sd, sh, sw] or auto"),
        (isinstance(cfg.parallel.overlap_halo, bool) or cfg.parallel.overlap_halo == "auto",
         f"parallel.overlap_halo={cfg.parallel.overlap_halo}: want true, false or auto"),
        (cfg.parallel.timeout_s > 0, f"parallel.timeout_s={cfg.parallel.timeout_s}: want > 0"),
        (cfg.parallel.heartbeat_s > 0, f"parallel.heartbeat_s={cfg.parallel.heartbeat_s}: want > 0"),
        (cfg.train.global_batch_size >= 1,
         f"train.global_batch_size={cfg.train.global_batch_size}: want >= 1"),
        (cfg.train.accum_steps >= 1, f"train.accum_steps={cfg.train.accum_steps}: want >= 1"),
        (cfg.train.epochs >= 1, f"train.epochs={cfg.train.epochs}: want >= 1"),
        (cfg.train.max_steps >= 0, f"train.max_steps={cfg.train.max_steps}: want >= 0"),
        (cfg.train.max_skipped_steps >= 0, f"train.max_skipped_steps={cfg.train.max_skipped_steps}: want >= 0"),
        (cfg.data.workers >= 0, f"data.workers={cfg.data.workers}: want >= 0"),
        (cfg.run.keep_checkpoints >= 1, f"run.keep_checkpoints={cfg.run.keep_checkpoints}: want >= 1"),
        (cfg.run.log_every >= 1, f"run.log_every={cfg.run.log_every}: want >= 1"),
        (cfg.run.checkpoint_every >= 0, f"run.checkpoint_every={cfg.run.checkpoint_every}: want >= 0"),
        (cfg.optim.lr > 0, f"optim.lr={cfg.optim.lr}: want > 0"),
        (str(cfg.parallel.verify).lower() in ("auto", "true", "false"),
         f"parallel.verify={cfg.parallel.verify}: want auto, true or false"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    from parallel.train import cases
    from parallel.train.optim import check_schedule

    try:
        check_schedule(cfg.sched, cfg.optim, cfg.train.global_batch_size)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    cases.validate(cfg)
    if str(cfg.optim.name) == "kfac":
        _validate_kfac(cfg)


def _validate_kfac(cfg: JobConfig) -> None:
    """``optim.kfac``'s settings, and what K-FAC's base step (torch's SGD) cannot do."""
    try:
        cfg.optim.kfac.validate()
    except ValueError as err:  # its messages name the field as kfac.<name>
        raise ConfigError(f"optim.{err}") from None
    if str(cfg.optim.momentum_form) == "keras":
        raise ConfigError("optim.momentum_form=keras: optim.name=kfac takes torch's SGD step on the "
                          "preconditioned gradients (b = m b + g; p -= lr b); set optim.momentum_form=torch")


def check_world(spatial: Sequence[int], world_size: int) -> None:
    """``ConfigError`` when ``parallel.spatial`` does not divide the world."""
    size = 1
    for s in spatial:
        size *= int(s)
    if world_size % size:
        sd, sh, sw = (int(s) for s in spatial)
        raise ConfigError(f"parallel.spatial=[{sd},{sh},{sw}] needs a multiple of {size} ranks, the job has "
                          f"{world_size}: data x spatial({sd}x{sh}x{sw}) cannot equal {world_size}")


@dataclass(frozen=True)
class SampleFacts:
    """What a job knows about its samples, read once (``read_facts``) and handed on: to the
    planner (``parallel.spatial=auto``), the checks, the readers and the model."""

    spec: SampleSpec
    """The family's sample spec, limited to the two fields trained on."""
    volume: tuple[int, int, int]
    """The global sample volume (D, H, W)."""
    channels: int
    """Channels of the input field."""
    input_itemsize: int
    """Bytes of one stored value of the input field."""
    source: Path
    """The file they were read from (the first training file)."""
    train_shapes: tuple[tuple[str, tuple[int, int, int]], ...] = ()
    """(file, (D, H, W)) of every training file (``check_data``; cases may differ in shape)."""
    val_shapes: tuple[tuple[str, tuple[int, int, int]], ...] = ()
    """(file, (D, H, W)) of every validation file."""

    @property
    def stored_bytes_per_voxel(self) -> int:
        """Bytes of one voxel of the input field as stored (all channels)."""
        return self.input_itemsize * self.channels


def read_facts(cfg: JobConfig, family: Family, first: Path | None = None, key: str = "data.train_subdir"
               ) -> SampleFacts:
    """The ``SampleFacts`` of the job, from ``first`` (default: the first training file)."""
    spec = family.trained_spec(crops=cfg.data.crop is not None and cfg.data.oversampling > 0)
    field = spec[family.input_field]
    if first is None:
        root = Path(cfg.data.dir) / cfg.data.train_subdir
        files = sample_files(root) if root.is_dir() else []
        if not files:
            raise InputError(f"{key}: no sample files under {root} (*.h5, *.hdf5)")
        first = files[0]
    import h5py

    try:
        with h5py.File(first, "r") as f:
            shape = f.attrs.get("global_shape")
            if shape is None and field.name in f and f[field.name].ndim >= 4:
                shape = f[field.name].shape[-3:]
            itemsize = f[field.name].dtype.itemsize if field.name in f else np.dtype(field.dtype).itemsize
    except OSError as err:
        raise InputError(f"{key}: {first}: cannot open as HDF5 (corrupt or truncated?): {err}") from err
    if shape is None or len(shape) != 3:
        raise InputError(f"{key}: {first}: no global_shape attribute and no volume field {field.name!r} "
                         "to take the volume from")
    volume = tuple(int(s) for s in shape)
    return SampleFacts(spec, volume, field.channels or 1, int(itemsize), Path(first))  # type: ignore[arg-type]


def _readable_dir(path: Path, key: str) -> None:
    if not path.exists():
        raise InputError(f"{key}: {path} does not exist")
    if not path.is_dir():
        raise InputError(f"{key}: {path} is not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise InputError(f"{key}: {path} is not readable (permissions)")


def _files(root: Path, key: str) -> tuple[list[Path], dict[str, int]]:
    """The sample files of a split and the sample counts its manifest claims."""
    _readable_dir(root, key)
    try:
        manifest = read_manifest(root)
    except (OSError, ValueError) as err:
        raise InputError(f"{key}: {root / 'manifest.json'} cannot be read ({err}); rewrite it with "
                         "parallel.data.write_manifest") from err
    counts: dict[str, int] = {}
    if manifest is not None:
        try:
            counts = {str(e["name"]): int(e["samples"]) for e in manifest["files"]}
        except (KeyError, TypeError, ValueError) as err:
            raise InputError(f"{key}: {root / 'manifest.json'} has no valid 'files' list "
                             f"of {{name, samples}} ({err})") from err
    files = sample_files(root)
    if not files:
        raise InputError(f"{key}: {root} holds no sample files (*.h5, *.hdf5)")
    return files, counts


def _manifest_problems(path: Path, claimed: int | None) -> list[str]:
    if claimed is None:
        return []
    import h5py

    try:
        with h5py.File(path, "r") as f:
            n = f.attrs.get("samples")
    except OSError:
        return []  # check_file reports it
    if n is not None and int(n) != claimed:
        return [f"manifest.json lists {claimed} samples, the file holds {int(n)}"]
    return []


def check_data(cfg: JobConfig, family: Family, grid: Grid, facts: SampleFacts | None = None) -> SampleFacts:
    """Check both splits' files (collective; each rank a share); the job's ``SampleFacts``
    (``facts`` if already read, else read here from the first training file).

    Raises ``InputError`` on every rank, quoting the first problems with their files.
    """
    mode = str(cfg.data.check)
    splits = [("train", cfg.data.train_subdir), ("val", cfg.data.val_subdir)]
    root = Path(cfg.data.dir)
    if not root.exists():
        raise InputError(f"data.dir: {root} does not exist; generate a set with {family.prepare_hint(cfg.data.dir)} "
                         "or point data.dir at one")
    if not root.is_dir() or not os.access(root, os.R_OK | os.X_OK):
        _readable_dir(root, "data.dir")
    roots = []
    for split, sub in splits:
        path = root / sub
        if not path.exists():
            raise InputError(
                f"data.dir={cfg.data.dir!r} has no {sub}/ directory ({path}); generate a set with "
                f"{family.prepare_hint(cfg.data.dir)} or point data.dir at one")
        roots.append((f"data.{split}_subdir", path))
    listed = [(key, path, *_files(path, key)) for key, path in roots]
    if facts is None:
        facts = read_facts(cfg, family, listed[0][2][0], listed[0][0])
    spec, volume = facts.spec, facts.volume
    try:
        if cfg.data.crop is None:  # crops are checked against the split instead (parallel.train.cases)
            grid.block_range(volume)
    except SplitError as err:
        raise InputError(f"parallel.spatial={list(grid.spatial)} cannot split the volume {list(volume)} of "
                         f"{listed[0][1]}: {err}") from err
    problems: list[str] = []
    from parallel.train.cases import weights_depend_on_volume

    # cases may differ in shape, unless the network's weights fix its volume
    one_volume = volume if cfg.data.crop is None and weights_depend_on_volume(family, cfg.model, volume) else None
    every = [(p, counts.get(p.name), split) for split, (_, _, files, counts) in enumerate(listed) for p in files]
    shapes: list[str] = []  # "split path D H W" of this rank's share: every case has its own shape
    for i in range(grid.rank, len(every), grid.world_size):
        path, claimed, split = every[i]
        if mode != "none":
            found = check_file(path, spec, deep=(mode == "deep"), volume=one_volume)
            found += _manifest_problems(path, claimed)
            problems.extend(f"{path}: {p}" for p in found)
        shape = _case_shape(path)
        if shape is not None:
            shapes.append(json.dumps([split, str(path), list(shape)]))
    problems = _gather_lines(problems, grid)
    if problems:
        more = f" (and {len(problems) - MAX_LISTED} more)" if len(problems) > MAX_LISTED else ""
        raise InputError(f"{len(problems)} problem(s) in the sample files of data.dir={cfg.data.dir!r}{more}:\n  "
                         + "\n  ".join(problems[:MAX_LISTED])
                         + f"\n`{family.prepare or 'the prepare command'} check DIR` lists every problem")
    found_shapes: list[tuple[tuple[str, tuple[int, int, int]], ...]] = [(), ()]
    for line in sorted(_gather_lines(shapes, grid), key=lambda t: (json.loads(t)[0], json.loads(t)[1])):
        split, path, shape = json.loads(line)
        found_shapes[split] += ((path, tuple(shape)),)
    return dataclasses.replace(facts, train_shapes=found_shapes[0], val_shapes=found_shapes[1])


def _case_shape(path: Path) -> tuple[int, int, int] | None:
    """The (D, H, W) a sample file declares (None when unreadable: the file check says why)."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            shape = f.attrs.get("global_shape")
    except OSError:
        return None
    return tuple(int(n) for n in shape) if shape is not None and len(shape) == 3 else None  # type: ignore[return-value]


def _gather_lines(lines: list[str], grid: Grid) -> list[str]:
    """Every rank's lines, on every rank, in rank order (raw UTF-8 bytes, no pickle)."""
    if grid.world_size == 1:
        return lines
    merged: list[str] = []
    for raw in comm.all_gather_bytes(json.dumps(lines).encode(), grid.world_group, caller="preflight"):
        merged.extend(json.loads(raw.decode()))
    return merged


def check_model(family: Family, model_cfg: Any, volume: Sequence[int], channels: int, grid: Grid,
                train: Any = None) -> None:
    """Raise ``InputError`` for a model/volume mismatch that would fail the first step,
    naming the layer and the sizes: a norm layer left with one voxel per channel
    (InstanceNorm on a 1x1x1 bottleneck; BatchNorm also with one sample per rank, from
    ``train``, the ``TrainConfig``), a kernel or stride beyond what reaches the layer, and
    a layer's input or output along a split dim with fewer voxels than blocks.

    The serial model is traced on the meta device (``parallel.plan.trace``: shapes only,
    nothing is allocated), at every grid.
    """
    from parallel.plan.trace import trace

    try:
        with torch.device("meta"):
            model = family.build_model(model_cfg, tuple(int(v) for v in volume))
    except (ValueError, TypeError) as err:  # the model's own checks of its config against the volume
        raise InputError(f"{family.name} model: {err}") from err
    if is_user_model(model_cfg):  # a network of the user's: does it fit the family's fields?
        try:
            check_user_model(model, family, model_cfg, volume, channels)
        except ValueError as err:
            raise InputError(str(err)) from err
    where = f"a volume of {list(volume)}"
    local_batch = None
    if train is not None:
        local_batch = max(1, train.global_batch_size // max(1, grid.data_size * train.accum_steps))
    entered: list[tuple[str, torch.nn.Module, tuple[int, ...]]] = []
    hooks = [m.register_forward_pre_hook(_norm_check(name, where, local_batch, entered))
             for name, m in model.named_modules() if not list(m.children())]
    model.eval()  # a batch of one on the tracer: batch norm's own check is the pre-hook's, per rank's batch
    try:
        layers = trace(model, (channels, *volume))
    except InputError:
        raise
    except (NotImplementedError, RuntimeError, ValueError) as err:
        if isinstance(err, NotImplementedError) or "meta" in str(err).lower():
            log.debug("shape check skipped: the model does not run on the meta device (%s)", err)
            return
        if entered:
            name, module, shape = entered[-1]
            raise InputError(f"layer '{name}' ({type(module).__name__}) cannot take its input of "
                             f"{'x'.join(map(str, shape))} voxels (C x D x H x W, per sample) at {where}: "
                             f"{str(err).splitlines()[0]}; use a larger volume or a shallower model") from err
        raise InputError(f"the model ({family.name}, model config {model_cfg}) cannot run on {where}: {err}") from err
    finally:
        for h in hooks:
            h.remove()
    if grid.spatial_size == 1:
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


def _norm_check(name: str, where: str, local_batch: int | None, entered: list) -> Any:
    """A forward pre-hook that notes the layer entered and refuses a norm layer whose
    statistics would span one value per channel (torch raises at the first training step)."""

    def hook(module: torch.nn.Module, args: tuple) -> None:
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
