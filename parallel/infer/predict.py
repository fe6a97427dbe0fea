"""The set-up every family's ``python -m <family>.predict`` shares.

A prediction reads a trained run (``run.dir``: ``config.yaml`` and a checkpoint), a
data set, and a grid, exactly as the training's evaluation does: each rank reads only its
block of each sample, through the family's transform (``Family.transform_for`` where the
files say which), and the spatial group runs the split model. The families' commands add
only what they write (``cosmoflow.predict``: a CSV; ``unet3d.predict``: label volumes).

``--data`` takes the data directory (``data.dir``, holding ``train/`` and ``val/``; the
``--split`` is read, ``val`` by default), one split directory (holding the sample files)
or one sample file, and defaults to the run's ``data.dir``; the log says which it read.
User errors (a missing run, data or checkpoint, a window the network cannot take, a split
the world cannot hold) end with one line from rank 0 and exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

import parallel
from parallel.data import BlockDataset
from parallel.data.format import sample_files
from parallel.data.reader import SampleReadError
from parallel.grid import Grid
from parallel.job import checkpoint
from parallel.job.family import Family
from parallel.job.from_hydra import UnknownKeyError, load_job
from parallel.runtime.launch import env_rank

log = logging.getLogger("parallel.predict")

EXIT_USER = 2
"""Exit status for bad arguments, runs or data (the message says what to change)."""


class UsageError(ValueError):
    """A user error of a prediction command: one line, exit 2."""


def parser(prog: str, doc: str | None, what: str) -> argparse.ArgumentParser:
    """The common options of a predict command (``what``: what the family's files hold)."""
    p = argparse.ArgumentParser(prog=prog, description=(doc or "").split("\n")[0],
                                epilog="\n".join((doc or "").split("\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", dest="run", type=Path, required=True, metavar="RUN",
                   help="the training run's run.dir (config.yaml, checkpoints/last.pt)")
    p.add_argument("--checkpoint", type=Path, default=None, help="default: RUN/checkpoints/last.pt")
    p.add_argument("--data", type=Path, default=None, metavar="DIR",
                   help=f"the data directory (data.dir, holding train/ and val/: --split is read), one split "
                        f"directory of {what} sample files, or one sample file; default: the run's data.dir")
    p.add_argument("--split", default="val", choices=["val", "train"],
                   help="the split read when --data is a data directory (default val)")
    p.add_argument("--spatial", type=int, nargs=3, default=[1, 1, 1], metavar=("SD", "SH", "SW"),
                   help="ways each sample is split along D, H, W (the data groups take the rest of the ranks)")
    return p


def resolve_data(path: Path | None, job: Any, split: str) -> tuple[Path, str]:
    """What ``--data`` names (see the module docstring) and a phrase saying which it is."""
    if path is None:
        path = Path(job.data.dir)
    if path.is_file():
        return path, f"the sample file {path}"
    if not path.is_dir():
        raise UsageError(f"--data {path}: no such directory or file (give the data directory, one of its "
                         "split directories, or a sample file)")
    sub = job.data.val_subdir if split == "val" else job.data.train_subdir
    if (path / sub).is_dir():
        return path / sub, f"the {split} split of the data directory {path} ({path / sub})"
    try:
        if sample_files(path):
            return path, f"the split directory {path}"
    except (OSError, ValueError):
        pass
    raise UsageError(f"--data {path}: holds no sample files (*.h5) and no {sub}/ split: give the data directory "
                     f"(data.dir) or one of its split directories")


@dataclass
class Session:
    """What a prediction runs on: the run's job config, the grid, the data and the weights."""

    job: Any
    grid: Grid
    dataset: BlockDataset
    has_target: bool
    state: dict[str, torch.Tensor]
    family: Family

    def model(self, volume: Sequence[int]) -> nn.Module:
        """The trained network for ``volume``, split for the grid, in eval mode
        (``UsageError`` when the network cannot take that volume)."""
        try:
            model = self.family.build_model(self.job.model, tuple(int(v) for v in volume))
            model.load_state_dict(self.state)
        except (ValueError, TypeError, RuntimeError) as err:
            raise UsageError(str(err)) from err
        return parallel.parallelize(model, self.grid, seed=0).eval()


def load_run(args: argparse.Namespace, family: Family) -> Any:
    """The job config ``--run-dir`` was trained with."""
    try:
        return load_job(args.run, family)
    except (FileNotFoundError, UnknownKeyError) as err:
        raise UsageError(f"--run-dir {args.run}: {err}") from err


def open_session(args: argparse.Namespace, family: Family, regions: Any = None, job: Any = None) -> Session:
    """Load the run (unless ``job`` is given), start the grid, open the data (collective:
    every rank calls it); ``regions``: the dataset's region policy."""
    job = job if job is not None else load_run(args, family)
    source, what = resolve_data(args.data, job, args.split)
    try:
        grid = parallel.init(list(args.spatial))
    except ValueError as err:
        raise UsageError(f"--spatial {' '.join(map(str, args.spatial))}: {err}") from err
    ds = BlockDataset(source, fields=None, grid=grid, regions=regions)
    ds.transform = family.transform_for(ds.attrs) if family.transform_for is not None else family.transform
    missing = [f for f in (family.input_field,) if f not in ds.fields]
    if missing:
        raise UsageError(f"{what}: the files hold no field {missing[0]!r} (fields {list(ds.fields)}): not "
                         f"{family.name} sample files")
    has_target = family.target_field in ds.fields
    ds.fields = tuple(f for f in (family.input_field, family.target_field) if f in ds.fields)
    path = args.checkpoint or checkpoint.checkpoint_path(args.run)
    try:
        state = checkpoint.load(path, grid.device)["model"]
    except (FileNotFoundError, checkpoint.CheckpointError, KeyError) as err:
        raise UsageError(f"--checkpoint {path}: {err}") from err
    if grid.rank == 0:
        log.info("predicting %d samples of %s with %s (%s)", len(ds), what, path, "targets present" if has_target
                 else "no targets")
    return Session(job, grid, ds, has_target, state, family)


def case_shapes(ds: BlockDataset) -> list[tuple[Path, tuple[int, int, int]]]:
    """(file, (D, H, W)) of every file of a dataset (read from each file's attributes)."""
    import h5py

    out = []
    for i in range(len(ds.files)):
        path = ds.files[i]
        try:
            with h5py.File(path, "r") as f:
                shape = tuple(int(n) for n in f.attrs["global_shape"])
        except (OSError, KeyError) as err:
            raise UsageError(f"{path}: cannot read its global_shape ({err})") from err
        out.append((path, shape))  # type: ignore[arg-type]
    return out


def run(prog: str, body: Callable[[], None]) -> int:
    """Run a predict command's ``body``: 0 after it, 2 and one line (from rank 0) for a user
    error; the process group is torn down either way."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    code = 0
    try:
        body()
    except (UsageError, SampleReadError, FileNotFoundError, PermissionError) as err:
        if env_rank() == 0:
            print(f"{prog}: error: {err}", file=sys.stderr)
        code = EXIT_USER
    finally:
        parallel.destroy()
    return code
