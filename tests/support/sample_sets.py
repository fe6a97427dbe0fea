"""Small CosmoFlow sample sets on disk, to be broken on purpose by the input-check tests
(tests/unit/test_checks_samples.py, tests/unit/test_checks_fit.py, tests/launch/test_cli_errors.py)."""

import re
from pathlib import Path

import h5py
import numpy as np
import pytest

from cosmoflow.family import CosmoFlowJob
from cosmoflow.fields import SPEC
from parallel.data.format import write_manifest, write_samples
from parallel.grid import Grid

SIZE = 8
SERIAL = Grid((1, 1, 1), 1, 0)


def sample(rng: np.random.Generator, size: int = SIZE) -> dict[str, np.ndarray]:
    return {"volume": rng.integers(0, 50, (1, 4, size, size, size), dtype=np.int16),
            "target": rng.uniform(-1, 1, (1, 4)).astype(np.float32)}


def make_set(root: Path, n_train: int = 4, n_val: int = 2) -> Path:
    """A valid set of ``n_train``/``n_val`` samples of SIZE^3 with their manifests."""
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("val", n_val)):
        (root / split).mkdir(parents=True)
        for i in range(n):
            write_samples(root / split / f"s{i:03d}.h5", SPEC, sample(rng))
        write_manifest(root / split, "cosmoflow")
    return root


def job_on(root: Path, **data: object) -> CosmoFlowJob:
    """The default CosmoFlow job reading ``root``, with ``data`` fields set."""
    job = CosmoFlowJob()
    job.data.dir = str(root)
    for k, v in data.items():
        setattr(job.data, k, v)
    return job


def rewrite(path: Path, **fields: np.ndarray | None) -> None:
    """Replace fields of a sample file in place (dropping those given as None)."""
    with h5py.File(path, "r+") as f:
        for name, value in fields.items():
            del f[name]
            if value is not None:
                f.create_dataset(name, data=value)


def fails(job: CosmoFlowJob, *patterns: str, grid: Grid = SERIAL) -> str:
    """``check_data`` refuses ``job``'s set with a message matching every pattern; the message."""
    from cosmoflow.family import FAMILY
    from parallel.job.errors import InputError
    from parallel.train.checks.samples import check_data

    with pytest.raises(InputError) as info:
        check_data(job.data, job.model, FAMILY, grid)
    text = str(info.value)
    for p in patterns:
        assert re.search(p, text), f"{p!r} not in:\n{text}"
    return text
