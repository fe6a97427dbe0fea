"""The preflight of cases of any shape: every case, crop and window checked against the
network and the split before anything is read, naming the key or file and the sizes."""

from __future__ import annotations

import pytest

from parallel.grid import Grid
from parallel.train import checks
from parallel.train.checks import ConfigError, InputError, validate_config
from unet3d.family import FAMILY as UNET
from unet3d.family import UNet3DJob
from unet3d.model import UNet3DConfig


def _job(**eval_and_data) -> UNet3DJob:
    job = UNet3DJob()
    job.model = UNet3DConfig(depth=3, base_filters=4, max_filters=8)
    job.train.global_batch_size = 2
    for key, value in eval_and_data.items():
        section, name = key.split("__")
        setattr(getattr(job, section), name, value)
    return job


def _grid(spatial=(1, 1, 1), data=1) -> Grid:
    world = data * spatial[0] * spatial[1] * spatial[2]
    return Grid(spatial=spatial, world_size=world, rank=0)


TRAIN = [("train/case_00000.h5", (40, 52, 33)), ("train/case_00001.h5", (61, 40, 40))]
VAL = [("val/case_00002.h5", (35, 41, 50)), ("val/case_00003.h5", (20, 44, 29))]


def test_crops_and_windows_that_fit_pass_for_cases_of_any_shape():
    for spatial, data in [((1, 1, 1), 1), ((2, 1, 1), 1), ((2, 2, 1), 1), ((2, 1, 1), 2)]:
        checks.check_cases(_job(data__crop=[32, 32, 32]), UNET, _grid(spatial, data), 1, TRAIN, VAL)


def test_a_crop_off_the_networks_stride_is_refused_by_key_and_size():
    with pytest.raises(InputError, match=r"data\.crop=\[30, 32, 32\]: model\.depth=3 needs volumes that are "
                                         r"multiples of 8 \(its total stride\) along D, H, W, got \(30, 32, 32\)"):
        checks.check_cases(_job(data__crop=[30, 32, 32]), UNET, _grid(), 1, TRAIN, VAL)


def test_a_split_that_cuts_a_strided_layer_off_its_stride_is_refused():
    # 24 = 3 x 8 fits the network alone; split 2 ways, blocks of 12 cut the third stride-2 conv at 3
    with pytest.raises(InputError, match=r"data\.crop=\[24, 32, 32\]: split 2 ways along dim D \(24 -> blocks "
                                         r"\[12, 12\]\).*not a multiple of its stride: blocks must be multiples "
                                         r"of the network's total stride 8 along D"):
        checks.check_cases(_job(data__crop=[24, 32, 32]), UNET, _grid((2, 1, 1)), 1, TRAIN, VAL)
    checks.check_cases(_job(data__crop=[24, 32, 32]), UNET, _grid((1, 2, 1)), 1, TRAIN, VAL)  # H: 32 -> 16, 16


def test_whole_mode_names_each_case_the_network_cannot_take():
    job = _job(data__crop=[32, 32, 32], eval__mode="whole")
    with pytest.raises(InputError) as err:
        checks.check_cases(job, UNET, _grid(), 1, TRAIN, VAL)
    text = str(err.value)
    assert "2 case(s) or setting(s)" in text
    assert "val/case_00002.h5 [35, 41, 50] (eval.mode=whole): model.depth=3 needs volumes that are multiples of 8" \
        in text and "val/case_00003.h5 [20, 44, 29]" in text
    ok = [("val/a.h5", (48, 48, 32)), ("val/b.h5", (48, 48, 32))]
    checks.check_cases(job, UNET, _grid((2, 1, 1)), 1, TRAIN, ok)


def test_sliding_window_names_cases_the_evaluation_cannot_keep_or_split():
    job = _job(data__crop=[32, 32, 32])
    tiny = [("val/tiny.h5", (7, 40, 40)), ("val/thin.h5", (40, 40, 9))]
    with pytest.raises(InputError) as err:
        checks.check_cases(job, UNET, _grid((1, 1, 2)), 1, TRAIN, tiny)
    text = str(err.value)
    assert "val/tiny.h5 [7, 40, 40]: a case of 7 voxels along dim D is shorter than half a stride" in text
    # 9 % 16 = 9 >= 8: kept whole, but 9 voxels still split 2 ways: no refusal here
    assert "thin.h5" not in text
    with pytest.raises(InputError, match=r"val/one\.h5 \[40, 40, 1\]: .* 1 voxels along dim W, fewer than its 2 "
                                         r"blocks"):
        checks.check_cases(_job(data__crop=[32, 32, 32], eval__window=[32, 32, 2]), UNET, _grid((1, 1, 2)), 1, TRAIN,
                    [("val/one.h5", (40, 40, 1))])


def test_whole_training_cases_of_different_shapes_need_one_case_per_group_and_step():
    job = _job(eval__mode="whole", data__crop=None)
    same = [("train/a.h5", (32, 32, 32)), ("train/b.h5", (32, 32, 32))]
    mixed = [("train/a.h5", (32, 32, 32)), ("train/b.h5", (40, 32, 32))]
    checks.check_cases(job, UNET, _grid(), 1, same, same)
    with pytest.raises(InputError, match=r"the training cases differ in shape .*2 per data group and step cannot be "
                                         r"stacked; set data.crop"):
        checks.check_cases(job, UNET, _grid(), 1, mixed, same)
    checks.check_cases(job, UNET, _grid(data=2), 1, mixed, same)  # one case per data group: fine


def test_config_errors_name_the_key():
    job = _job(data__crop=None, eval__window=None)
    with pytest.raises(ConfigError, match="eval.mode=sliding needs a window"):
        validate_config(job)
    with pytest.raises(ConfigError, match=r"data.crop=\[32, 32\]: want three positive sizes"):
        validate_config(_job(data__crop=[32, 32]))
    with pytest.raises(ConfigError, match=r"eval.overlap=1.0"):
        validate_config(_job(eval__overlap=1.0))
    with pytest.raises(ConfigError, match=r"eval.overlap=0.25 with the window \[32, 32, 32\]: windows of 32 with "
                                          r"stride 24"):
        validate_config(_job(eval__overlap=0.25, data__crop=[32, 32, 32]))
    validate_config(_job())


def test_a_warmup_that_lowers_the_rate_is_a_config_error_in_validation():
    from cosmoflow.family import CosmoFlowJob

    job = CosmoFlowJob()
    job.train.global_batch_size = 16  # peak 0.001 x 16 / 64 below the warmup's start 0.001
    with pytest.raises(ConfigError, match=r"the warmup \(sched.warmup_epochs=4\) starts at optim.lr"):
        validate_config(job)
    job.sched.warmup_epochs = 0
    validate_config(job)
