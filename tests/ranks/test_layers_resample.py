"""Upsample, adaptive pooling and padding against their torch.nn twins (float64, real gloo
ranks): output, input gradient and parameter gradients, every split dim, uneven blocks,
data x spatial."""

import math
import re
from functools import partial

import pytest
from torch import nn

import cases
import resample_cases as rc

C = partial
D2, H3, W4 = (2, 1, 1), (1, 3, 1), (1, 1, 4)
UP = partial(nn.Upsample)

UPSAMPLE = [
    ("nearest-x2-D2", C(UP, scale_factor=2), (2, 2, 5, 4, 3), D2),
    ("nearest-x2-H3-uneven7", C(UP, scale_factor=2), (1, 2, 3, 7, 4), H3),
    ("nearest-size-13-from-9-W4", C(UP, size=(5, 6, 13)), (1, 2, 4, 4, 9), W4),
    ("nearest-x1.5-D2-uneven", C(UP, scale_factor=1.5), (1, 2, 7, 3, 4), D2),
    ("nearest-x1.7-recompute-H3", C(UP, scale_factor=1.7, recompute_scale_factor=True), (1, 2, 3, 8, 3), H3),
    ("nearest-exact-size-W4", C(UP, size=(4, 4, 11), mode="nearest-exact"), (1, 2, 4, 4, 7), W4),
    ("nearest-downsample-D2", C(UP, size=(3, 4, 4)), (1, 2, 7, 4, 4), D2),
    ("trilinear-x2-D2", C(UP, scale_factor=2, mode="trilinear"), (2, 2, 5, 4, 3), D2),
    ("trilinear-x2-H3-uneven7", C(UP, scale_factor=2, mode="trilinear"), (1, 2, 3, 7, 4), H3),
    ("trilinear-x3-W4", C(UP, scale_factor=3, mode="trilinear"), (1, 2, 3, 3, 10), W4),
    ("trilinear-align-x2-D2-uneven", C(UP, scale_factor=2, mode="trilinear", align_corners=True), (1, 2, 7, 3, 4), D2),
    ("trilinear-align-size-W4", C(UP, size=(5, 4, 13), mode="trilinear", align_corners=True), (1, 2, 4, 3, 9), W4),
    ("trilinear-size-nonint-1x2x2", C(UP, size=(6, 9, 11), mode="trilinear"), (1, 2, 4, 5, 7), (1, 2, 2)),
    ("trilinear-align-size-2x2x1", C(UP, size=(11, 7, 5), mode="trilinear", align_corners=True), (1, 2, 5, 4, 5),
     (2, 2, 1)),
    ("trilinear-per-dim-scales-2x2x2", C(UP, scale_factor=(2, 1, 3), mode="trilinear"), (1, 2, 4, 5, 3), (2, 2, 2)),
    ("trilinear-shrink-H3", C(UP, size=(4, 5, 4), mode="trilinear"), (1, 2, 4, 13, 4), H3),
    ("area-size-D2", C(UP, size=(3, 4, 4), mode="area"), (1, 2, 9, 4, 4), D2),
    ("trilinear-data2-spatial2", C(UP, scale_factor=2, mode="trilinear"), (4, 2, 5, 3, 3), D2 + ("data2",)),
]
ADAPTIVE = [
    ("avg-global-D2", C(rc.flattened, C(nn.AdaptiveAvgPool3d, 1)), (2, 2, 6, 4, 4), D2),
    ("avg-global-H3-uneven", C(rc.flattened, C(nn.AdaptiveAvgPool3d, 1)), (1, 2, 3, 7, 4), H3),
    ("avg-global-2x2x2", C(rc.flattened, C(nn.AdaptiveAvgPool3d, (1, 1, 1))), (1, 2, 5, 4, 3), (2, 2, 2)),
    ("avg-global-DH-keep-W-1x2x2", C(rc.flattened, C(nn.AdaptiveAvgPool3d, (2, 1, 1))), (1, 2, 5, 4, 3), (1, 2, 2)),
    ("avg-3x2x4-D2", C(nn.AdaptiveAvgPool3d, (3, 2, 4)), (1, 2, 7, 5, 9), D2),
    ("avg-keep-H-None-H3", C(nn.AdaptiveAvgPool3d, (4, None, 3)), (1, 2, 8, 5, 7), H3),
    ("avg-5-from-13-W4", C(nn.AdaptiveAvgPool3d, 5), (1, 2, 3, 4, 13), W4),
    ("avg-global-data2-spatial2", C(rc.flattened, C(nn.AdaptiveAvgPool3d, 1)), (4, 2, 6, 3, 3), D2 + ("data2",)),
    ("max-global-W4-ties", C(rc.flattened, C(rc.tied_max, 1)), (2, 2, 3, 3, 9), W4),
    ("max-global-2x2x1-ties", C(rc.flattened, C(rc.tied_max, 1)), (1, 3, 4, 5, 3), (2, 2, 1)),
    ("max-2x3x3-2x2x1-ties", C(rc.tied_max, (2, 3, 3)), (1, 2, 5, 7, 6), (2, 2, 1)),
    ("max-4-from-11-H3", C(nn.AdaptiveMaxPool3d, (2, 4, 2)), (1, 2, 4, 11, 5), H3),
    ("max-global-data2-spatial2", C(rc.flattened, C(rc.tied_max, 1)), (4, 2, 3, 6, 3), (1, 2, 1, "data2")),
]
PAD = [
    ("constant-D2", C(nn.ConstantPad3d, (1, 2, 0, 1, 2, 1), 0.5), (1, 2, 5, 3, 4), D2),
    ("constant-H3-uneven", C(nn.ConstantPad3d, (0, 1, 2, 3, 1, 0), -1.0), (1, 2, 3, 7, 4), H3),
    ("zero-W4", C(nn.ZeroPad3d, (3, 1, 1, 1, 0, 0)), (1, 2, 3, 3, 9), W4),
    ("crop-negative-2x2x1", C(nn.ConstantPad3d, (-1, 0, 0, -2, -1, 2), 0.0), (1, 2, 6, 7, 5), (2, 2, 1)),
    ("circular-1x2x2", C(nn.CircularPad3d, (1, 2, 2, 1, 1, 1)), (1, 2, 3, 6, 7), (1, 2, 2)),
    ("circular-D2", C(nn.CircularPad3d, 2), (2, 2, 6, 3, 3), D2),
]
HEADS = [
    ("global-pool-flatten-linear-D2", rc.classifier_head, (2, 3, 6, 4, 4), D2),
    ("global-pool-flatten-linear-1x2x2", rc.classifier_head, (1, 3, 4, 6, 5), (1, 2, 2)),
    ("global-pool-flatten-linear-data2-spatial2", rc.classifier_head, (4, 3, 6, 4, 4), D2 + ("data2",)),
    ("global-pool-relu-flatten-linear-W4", rc.pool_relu_head, (2, 3, 3, 4, 9), W4),
    ("global-max-view-linear-2x2x1", rc.ViewHead, (2, 2, 6, 5, 4), (2, 2, 1)),
    ("squeeze-excite-replicated-times-block-W4", rc.Excite, (2, 2, 3, 4, 9), W4),
    ("squeeze-excite-data2-spatial2", rc.Excite, (4, 2, 4, 6, 3), (1, 2, 1, "data2")),
]


def _run(pools, build, shape, spatial):
    data = 1
    if len(spatial) == 4:
        spatial, data = spatial[:3], 2
    pools.run(math.prod(spatial) * data, rc.check_f64, build, shape, spatial=spatial)


@pytest.mark.parametrize("build,shape,spatial", [c[1:] for c in UPSAMPLE], ids=[c[0] for c in UPSAMPLE])
def test_upsample(pools, build, shape, spatial):
    _run(pools, build, shape, spatial)


@pytest.mark.parametrize("build,shape,spatial", [c[1:] for c in ADAPTIVE], ids=[c[0] for c in ADAPTIVE])
def test_adaptive_pool(pools, build, shape, spatial):
    _run(pools, build, shape, spatial)


@pytest.mark.parametrize("build,shape,spatial", [c[1:] for c in PAD], ids=[c[0] for c in PAD])
def test_pad(pools, build, shape, spatial):
    _run(pools, build, shape, spatial)


@pytest.mark.parametrize("build,shape,spatial", [c[1:] for c in HEADS], ids=[c[0] for c in HEADS])
def test_global_pool_heads_run_as_serial(pools, build, shape, spatial):
    _run(pools, build, shape, spatial)


ERRORS = [
    ("pool-to-1-along-D-but-keep-split-H", C(nn.AdaptiveAvgPool3d, (1, 4, 4)), (1, 1, 4, 4, 4), (2, 2, 1),
     r"layer 'AdaptiveAvgPool3d' \(AdaptiveAvgPool3d\): output size \(1, 4, 4\) pools split dim\(s\) D to 1 but "
     r"keeps split dim\(s\) H"),
    ("adaptive-output-between-1-and-blocks", C(nn.AdaptiveMaxPool3d, 2), (1, 1, 4, 4, 8), W4,
     r"output size 2 along dim W \(input 8\) cannot be split 4 ways"),
    ("upsample-output-smaller-than-grid", C(UP, size=(2, 4, 4)), (1, 1, 4, 4, 4), (4, 1, 1),
     r"layer 'Upsample' \(Upsample\): output size 2 along dim D \(input 4\) cannot be split 4 ways"),
    ("reflection-pad-refused", C(nn.Sequential, nn.ReflectionPad3d(1)), (1, 1, 4, 4, 4), D2,
     r"layer '0' \(ReflectionPad3d\) mirrors voxels at the volume's edges"),
    ("replication-pad-refused", C(nn.Sequential, nn.ReplicationPad3d(1)), (1, 1, 4, 4, 4), D2,
     r"layer '0' \(ReplicationPad3d\) repeats the volume's edge voxels"),
    ("replicate-conv-refused", C(nn.Sequential, nn.Conv3d(1, 1, 3, padding=1, padding_mode="replicate")),
     (1, 1, 4, 4, 4), D2, r"layer '0' \(Conv3d\): padding_mode 'replicate' is not supported"),
    ("pixel-shuffle-refused", C(nn.Sequential, nn.PixelShuffle(2)), (1, 4, 4, 4, 4), D2,
     r"layer '0' \(PixelShuffle\) moves channels into D/H/W"),
    ("layernorm-refused", C(nn.Sequential, nn.LayerNorm(4)), (1, 1, 4, 4, 4), D2, r"layer '0' \(LayerNorm\)"),
]


@pytest.mark.parametrize("build,shape,spatial,expected", [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS])
def test_unsplittable_resampling_is_refused_with_the_numbers(pools, build, shape, spatial, expected):
    messages = pools.run(math.prod(spatial), cases.expect_error, build, shape, spatial=spatial, timeout=60)
    assert all(re.search(expected, m) for m in messages), messages


def test_a_replicated_volume_as_model_output_counts_its_gradient_once(pools):
    pools.run(4, rc.replicated_volume_output, spatial=(1, 2, 2))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_split_global_pool_of_a_low_precision_volume_sums_in_float32(pools, dtype):
    """The blocks' partial sums of a global average pool are not rounded rank by rank: the
    split pool equals the serial pool under autocast (float32 on CPUs) to float32 rounding
    (W and H split: no unsplit dim is pooled first by torch's own kernel, which autocast runs in
    float32 on CPUs; with the partial sums rounded, the split pool was 1.5e-3 off in bf16, 3e-4 in fp16)."""
    assert max(pools.run(4, rc.global_pool_low_precision, dtype, spatial=(1, 2, 2))) < 1e-6
