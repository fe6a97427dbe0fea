"""The checks of a job, in the order ``train()`` calls them (``parallel.train.checks``),
on real sample files: ``before_grid`` (no process group: the config's values, the sample
facts, the network at its volume) -> ``on_grid`` (every file, every case against the
network and the split)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from cosmoflow.family import FAMILY as COSMO
from cosmoflow.family import CosmoFlowJob
from cosmoflow.fields import SPEC
from cosmoflow.model import CosmoFlowConfig
from parallel.data.format import write_manifest, write_samples
from parallel.grid import Grid
from parallel.train.checks import ConfigError, InputError, before_grid, on_grid

SERIAL = Grid((1, 1, 1), 1, 0)


@pytest.fixture
def job(tmp_path: Path) -> CosmoFlowJob:
    rng = np.random.default_rng(0)
    for split, n in (("train", 2), ("val", 1)):
        (tmp_path / split).mkdir()
        for i in range(n):
            write_samples(tmp_path / split / f"s{i}.h5", SPEC,
                          {"volume": rng.integers(0, 50, (1, 4, 16, 16, 16), dtype=np.int16),
                           "target": rng.uniform(-1, 1, (1, 4)).astype(np.float32)})
        write_manifest(tmp_path / split, "cosmoflow")
    job = CosmoFlowJob()
    job.data.dir = str(tmp_path)
    job.model = CosmoFlowConfig(conv_filters=4, n_conv_blocks=2, dense_sizes=[8])
    job.train.global_batch_size = 1
    job.sched.warmup_epochs = 0  # a batch of one: no warmup from a rate above its peak
    return job


def test_the_plan_before_the_grid_then_every_case_on_it(job):
    plan = before_grid(job, COSMO)  # one file read: the facts; no case shapes yet
    assert plan.volume == (16, 16, 16) and plan.facts.channels == 4 and plan.facts.train_shapes == ()
    plan = on_grid(plan, job, COSMO, SERIAL)
    assert len(plan.facts.train_shapes) == 2 and len(plan.facts.val_shapes) == 1
    assert plan.volume == (16, 16, 16)


def test_each_check_raises_the_jobs_input_errors(job, tmp_path):
    job.train.accum_steps = 0
    with pytest.raises(ConfigError, match=r"train\.accum_steps=0: want >= 1"):
        before_grid(job, COSMO)
    job.train.accum_steps = 1
    (tmp_path / "val" / "s0.h5").write_bytes(b"not hdf5")
    plan = before_grid(job, COSMO)  # the first training file is fine: nothing else is read yet
    with pytest.raises(InputError, match=r"(?s)1 problem\(s\) in the sample files .*val/s0\.h5: cannot open as HDF5"):
        on_grid(plan, job, COSMO, SERIAL)
    job.model = CosmoFlowConfig(conv_filters=4, n_conv_blocks=5, dense_sizes=[8])  # 16 -> 0 after 5 poolings
    with pytest.raises(InputError, match=r"cosmoflow model: .*"):
        before_grid(job, COSMO)  # the network against its volume: before any process group


def test_one_meta_trace_names_the_layer_for_crops_and_whole_cases():
    """Crops, windows and whole cases go through the one meta-device trace (``meta_trace``)
    that ``check_model`` uses: the same layer is named the same way for each."""
    from parallel.job.family import model_config
    from parallel.train.checks import check_cases
    from unet3d.family import FAMILY as UNET
    from unet3d.family import UNet3DJob

    job = UNet3DJob()
    job.model = model_config(UNET)  # the MLPerf U-Net: 5 stride-2 levels take 32^3 to 1^3
    job.data.crop = [32, 32, 32]
    job.eval.mode = "whole"
    with pytest.raises(InputError) as err:
        check_cases(job, UNET, SERIAL, 1, [("train/a.h5", (64, 64, 64))], [("val/b.h5", (32, 32, 32))])
    norm = (r": layer 'down\.4\.0\.1' \(InstanceNorm3d\) normalises each channel over its 1x1x1 voxel\(s\) at a "
            r"volume of \[32, 32, 32\]: instance norm needs more than one")
    assert re.search(r"data\.crop=\[32, 32, 32\]" + norm, str(err.value)), err.value
    assert re.search(r"val/b\.h5 \[32, 32, 32\] \(eval\.mode=whole\)" + norm, str(err.value)), err.value
