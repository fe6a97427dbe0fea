"""The checks of a job run as one pass, in order: validate -> samples -> fit -> verify
(``parallel.train.checks.JobChecks``), on real sample files."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from cosmoflow.family import FAMILY as COSMO, CosmoFlowJob
from cosmoflow.fields import SPEC
from cosmoflow.model import CosmoFlowConfig
from parallel.data.format import write_manifest, write_samples
from parallel.grid import Grid
from parallel.train.checks import PHASES, ConfigError, InputError, JobChecks

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


def test_the_phases_run_once_each_in_order(job):
    checks = JobChecks(job, COSMO)
    checks.validate()
    facts = checks.samples(SERIAL)
    assert facts.volume == (16, 16, 16) and len(facts.train_shapes) == 2 and len(facts.val_shapes) == 1
    assert checks.fit(SERIAL) == (16, 16, 16)
    built = []
    model = COSMO.build_model(job.model, (16, 16, 16))
    assert checks.verify(model, lambda: built.append(1) or model, SERIAL) is model and built == [1]
    assert checks.done == list(PHASES)
    with pytest.raises(RuntimeError, match=r"'validate' called after \['validate', 'samples', 'fit', 'verify'\]"):
        checks.validate()


@pytest.mark.parametrize("skipped", PHASES[:3])
def test_a_phase_out_of_order_is_refused(job, skipped):
    checks = JobChecks(job, COSMO)
    run = {"validate": checks.validate, "samples": lambda: checks.samples(SERIAL),
           "fit": lambda: checks.fit(SERIAL)}
    for phase in PHASES[:PHASES.index(skipped)]:
        run[phase]()
    after = PHASES[PHASES.index(skipped) + 1]
    with pytest.raises(RuntimeError, match=f"'{after}' called after .* the order is validate -> samples -> fit"):
        (run | {"verify": lambda: checks.verify(None, lambda: None, SERIAL)})[after]()  # type: ignore[arg-type]


def test_each_phase_raises_the_jobs_input_errors(job, tmp_path):
    job.train.accum_steps = 0
    with pytest.raises(ConfigError, match=r"train\.accum_steps=0: want >= 1"):
        JobChecks(job, COSMO).validate()
    job.train.accum_steps = 1
    (tmp_path / "val" / "s0.h5").write_bytes(b"not hdf5")
    checks = JobChecks(job, COSMO)
    checks.validate()
    with pytest.raises(InputError, match=r"(?s)1 problem\(s\) in the sample files .*val/s0\.h5: cannot open as HDF5"):
        checks.samples(SERIAL)


def test_one_meta_trace_names_the_layer_for_crops_and_whole_cases():
    """Crops, windows and whole cases go through the one meta-device trace (``meta_trace``)
    that ``check_model`` uses: the same layer is named the same way for each."""
    from parallel.train.checks import check_cases
    from parallel.job.family import model_config
    from unet3d.family import FAMILY as UNET, UNet3DJob

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
