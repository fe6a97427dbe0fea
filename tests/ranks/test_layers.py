"""Each spatial layer against its torch.nn twin: output, input gradient, parameter
gradients and running statistics, on real gloo ranks."""

import math
from functools import partial

import pytest
from torch import nn

import cases

C = partial  # a layer constructor with its arguments: C(nn.Conv3d, 2, 3, 3)

D2, H3, W4 = (2, 1, 1), (1, 3, 1), (1, 1, 4)

# (id, constructor, global input shape, spatial split)
CONV = [
    ("k1-D2", C(nn.Conv3d, 2, 3, 1), (2, 2, 8, 5, 4), D2),
    ("k2-valid-D2-uneven", C(nn.Conv3d, 2, 3, 2), (2, 2, 9, 5, 4), D2),
    ("k3-pad1-D2", C(nn.Conv3d, 2, 3, 3, padding=1), (2, 2, 8, 5, 4), D2),
    ("k5-pad2-H3-uneven19", C(nn.Conv3d, 2, 3, 5, padding=2), (1, 2, 6, 19, 5), H3),
    ("k5-pad2-W4-halo-wider-than-block", C(nn.Conv3d, 2, 2, 5, padding=2), (1, 2, 4, 5, 9), W4),
    ("k3-stride2-pad1-D2", C(nn.Conv3d, 2, 3, 3, stride=2, padding=1), (2, 2, 8, 5, 4), D2),
    ("k3-stride2-pad1-H3-uneven19", C(nn.Conv3d, 2, 3, 3, stride=2, padding=1), (1, 2, 5, 19, 4), H3),
    ("k2-stride2-W4-odd", C(nn.Conv3d, 2, 3, 2, stride=2), (1, 2, 4, 5, 17), W4),
    ("k3-dilation2-pad2-D2", C(nn.Conv3d, 2, 3, 3, dilation=2, padding=2), (2, 2, 10, 5, 4), D2),
    ("k5-dilation2-stride2-W4", C(nn.Conv3d, 2, 3, 5, dilation=2, stride=2, padding=3), (1, 2, 4, 4, 18), W4),
    ("k3-same-H3", C(nn.Conv3d, 2, 3, 3, padding="same"), (1, 2, 5, 10, 4), H3),
    ("k4-same-even-kernel-W4", C(nn.Conv3d, 2, 3, 4, padding="same"), (1, 2, 4, 4, 13), W4),
    ("k3-valid-D2", C(nn.Conv3d, 2, 3, 3, padding="valid"), (2, 2, 9, 5, 4), D2),
    ("k3-circular-D2", C(nn.Conv3d, 2, 3, 3, padding=1, padding_mode="circular"), (2, 2, 8, 5, 4), D2),
    ("k5-circular-W4-uneven", C(nn.Conv3d, 2, 3, 5, padding=2, padding_mode="circular"), (1, 2, 4, 4, 10), W4),
    ("k3-circular-stride2-H3", C(nn.Conv3d, 2, 3, 3, stride=2, padding=1, padding_mode="circular"), (1, 2, 4, 12, 4), H3),
    ("k3-groups2-nobias-D2", C(nn.Conv3d, 4, 6, 3, padding=1, groups=2, bias=False), (2, 4, 8, 4, 4), D2),
    ("k3-anisotropic-2x2x1", C(nn.Conv3d, 2, 3, (3, 5, 1), stride=(1, 2, 1), padding=(1, 2, 0)), (1, 2, 7, 9, 4), (2, 2, 1)),
    ("k3-corners-1x2x2", C(nn.Conv3d, 2, 3, 3, padding=1), (1, 2, 4, 7, 6), (1, 2, 2)),
    ("k3-circular-corners-2x2x1", C(nn.Conv3d, 2, 3, 3, padding=1, padding_mode="circular"), (1, 2, 6, 5, 4), (2, 2, 1)),
    ("k3-corners-2x2x2", C(nn.Conv3d, 2, 3, 3, padding=1), (1, 2, 5, 6, 7), (2, 2, 2)),
    # Thin batch-1 blocks that conv3d reorders for oneDNN (N*C*D*H <= 20480 < N*C*H*W).
    ("k3-pad1-D2-thin-reordered", C(nn.Conv3d, 8, 4, 3, padding=1), (1, 8, 8, 64, 64), D2),
    ("k313-stride121-D2-thin-reordered", C(nn.Conv3d, 8, 4, (3, 1, 3), stride=(1, 2, 1), padding=(1, 0, 1)),
     (1, 8, 6, 64, 48), D2),
]
TRANSPOSED = [
    ("k2-stride2-D2", C(nn.ConvTranspose3d, 3, 2, 2, stride=2), (2, 3, 5, 4, 4), D2),
    ("k3-stride1-pad1-H3-uneven", C(nn.ConvTranspose3d, 3, 2, 3, padding=1), (1, 3, 4, 7, 4), H3),
    ("k3-stride2-pad1-outpad1-W4", C(nn.ConvTranspose3d, 3, 2, 3, stride=2, padding=1, output_padding=1), (1, 3, 4, 4, 6), W4),
    ("k4-stride2-pad1-D2", C(nn.ConvTranspose3d, 3, 2, 4, stride=2, padding=1), (2, 3, 5, 4, 4), D2),
    ("k3-dilation2-stride2-H3", C(nn.ConvTranspose3d, 3, 2, 3, stride=2, dilation=2, padding=2), (1, 3, 4, 7, 4), H3),
    ("k5-groups-nobias-D2", C(nn.ConvTranspose3d, 4, 4, 5, stride=2, padding=2, groups=2, bias=False), (1, 4, 5, 4, 4), D2),
    ("k2-stride2-2x2x1", C(nn.ConvTranspose3d, 3, 2, 2, stride=2), (1, 3, 5, 3, 4), (2, 2, 1)),
    ("k3-stride2-1x2x2", C(nn.ConvTranspose3d, 3, 2, 3, stride=2, padding=1, output_padding=1), (1, 3, 4, 5, 5), (1, 2, 2)),
]
POOL = [
    ("max-k2-D2", C(nn.MaxPool3d, 2), (2, 2, 8, 4, 4), D2),
    ("max-k2-H3-odd-uneven", C(nn.MaxPool3d, 2), (1, 2, 4, 19, 4), H3),
    ("max-k3-stride2-pad1-W4", C(nn.MaxPool3d, 3, 2, 1), (1, 2, 4, 4, 13), W4),
    ("max-k3-stride1-pad1-D2", C(nn.MaxPool3d, 3, 1, 1), (2, 2, 7, 4, 4), D2),
    ("max-k2-ceil-H3", C(nn.MaxPool3d, 2, ceil_mode=True), (1, 2, 4, 13, 4), H3),
    ("max-k2-dilation2-D2", C(nn.MaxPool3d, 2, 1, dilation=2), (2, 2, 9, 4, 4), D2),
    ("max-k2-2x2x2", C(nn.MaxPool3d, 2), (1, 2, 6, 6, 8), (2, 2, 2)),
    ("avg-k2-D2", C(nn.AvgPool3d, 2), (2, 2, 8, 4, 4), D2),
    ("avg-k3-stride2-pad1-H3", C(nn.AvgPool3d, 3, 2, 1), (1, 2, 4, 13, 4), H3),
    ("avg-k3-pad1-exclude-pad-W4", C(nn.AvgPool3d, 3, 1, 1, count_include_pad=False), (1, 2, 4, 4, 10), W4),
    ("avg-k3-stride2-ceil-exclude-pad-D2", C(nn.AvgPool3d, 3, 2, 1, ceil_mode=True, count_include_pad=False), (1, 2, 10, 4, 4), D2),
    ("avg-k2-ceil-include-pad-H3", C(nn.AvgPool3d, 2, ceil_mode=True), (1, 2, 4, 13, 4), H3),
    ("avg-k2-divisor-override-1x2x2", C(nn.AvgPool3d, 2, divisor_override=3), (1, 2, 4, 6, 6), (1, 2, 2)),
]
NORM = [
    ("batchnorm-D2", C(nn.BatchNorm3d, 3), (2, 3, 8, 4, 4), D2, {}),
    ("batchnorm-momentum-None-H3", C(nn.BatchNorm3d, 3, momentum=None), (2, 3, 4, 7, 4), H3, {"steps": 2}),
    ("batchnorm-2x2x1-eval", C(nn.BatchNorm3d, 3), (2, 3, 6, 5, 4), (2, 2, 1), {"eval_after": True}),
    ("batchnorm-data2-spatial2-per-group", C(nn.BatchNorm3d, 3), (4, 3, 6, 4, 4), D2 + ("data2",), {}),
    ("batchnorm-data2-spatial2-synced", C(nn.BatchNorm3d, 3), (4, 3, 6, 4, 4), D2 + ("data2",), {"sync_batchnorm": True}),
    ("instancenorm-W4", C(nn.InstanceNorm3d, 3), (2, 3, 4, 4, 9), W4, {}),
    ("instancenorm-affine-running-1x2x2-eval", C(nn.InstanceNorm3d, 3, affine=True, track_running_stats=True),
     (2, 3, 4, 6, 5), (1, 2, 2), {"eval_after": True, "steps": 2}),
    ("groupnorm-2groups-D2", C(nn.GroupNorm, 2, 4), (2, 4, 7, 4, 4), D2, {}),
    ("groupnorm-1group-2x2x2", C(nn.GroupNorm, 1, 4), (1, 4, 4, 5, 6), (2, 2, 2), {}),
]


def _run(pools, build, shape, spatial, **kw):
    data = 1
    if len(spatial) == 4:
        spatial, data = spatial[:3], 2
    world = math.prod(spatial) * data
    pools.run(world, cases.check_module, build, shape, 0, kw.get("sync_batchnorm", False),
              kw.get("eval_after", False), kw.get("steps", 1), spatial=spatial)


@pytest.mark.parametrize("build,shape,spatial", [c[1:] for c in CONV], ids=[c[0] for c in CONV])
def test_conv3d(pools, build, shape, spatial):
    _run(pools, build, shape, spatial)


@pytest.mark.parametrize("kernel,stride,padding,dilation,shape", [
    (3, 1, 1, 1, (1, 8, 5, 64, 64)),
    ((3, 1, 5), (1, 2, 1), (0, 0, 2), 1, (1, 4, 3, 72, 80)),
    (3, 2, 1, 2, (1, 8, 64, 5, 64)),     # thin along H: the two large dims go first
    (3, 1, 0, 1, (1, 2, 8, 8, 8)),       # small everywhere: torch's own choice, unchanged
])
def test_conv3d_reorders_thin_blocks_and_equals_torch(kernel, stride, padding, dilation, shape):
    import torch
    import torch.nn.functional as F

    from parallel.layers.conv.kernels import conv3d, conv3d_backward

    torch.manual_seed(0)
    conv = nn.Conv3d(shape[1], 3, kernel, stride, padding, dilation)
    x = torch.randn(shape, requires_grad=True)
    y = conv3d(x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, 1)
    reordered = not y.is_contiguous()
    assert reordered == (shape != (1, 2, 8, 8, 8))
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, conv.weight, conv.bias), g)
    # Against float64 truth, as close as torch's own float32 convolution is (sums of ~20k terms).
    params = [t.detach().double().requires_grad_() for t in (x, conv.weight, conv.bias)]
    ref = F.conv3d(*params, conv.stride, conv.padding, conv.dilation)
    ref_grads = torch.autograd.grad(ref, params, g.double())
    f32 = F.conv3d(x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation)
    f32_grads = torch.autograd.grad(f32, (x, conv.weight, conv.bias), g)
    # The backward the overlapped conv calls directly, reordered the same way.
    gi, gw = conv3d_backward(g, x.detach(), conv.weight.detach(), conv.stride, conv.padding, conv.dilation, 1,
                             (True, True))
    for name, ours, theirs, truth in zip(("output", "input grad", "weight grad", "bias grad", "backward's input grad",
                                          "backward's weight grad"), (y, *grads, gi, gw),
                                         (f32, *f32_grads, f32_grads[0], f32_grads[1]), (ref, *ref_grads, *ref_grads[:2])):
        truth = truth.detach()
        scale = float(truth.abs().max())
        err = float((ours.detach().double() - truth).abs().max())
        torch_err = float((theirs.detach().double() - truth).abs().max())
        assert err <= max(4 * torch_err, 1e-6 * scale), (name, err, torch_err, scale)


@pytest.mark.parametrize("build,shape,spatial", [c[1:] for c in TRANSPOSED], ids=[c[0] for c in TRANSPOSED])
def test_conv_transpose3d(pools, build, shape, spatial):
    _run(pools, build, shape, spatial)


@pytest.mark.parametrize("build,shape,spatial", [c[1:] for c in POOL], ids=[c[0] for c in POOL])
def test_pool3d(pools, build, shape, spatial):
    _run(pools, build, shape, spatial)


@pytest.mark.parametrize("build,shape,spatial,kw", [c[1:] for c in NORM], ids=[c[0] for c in NORM])
def test_norm(pools, build, shape, spatial, kw):
    _run(pools, build, shape, spatial, **kw)


def test_flatten_linear_dropout_head(pools):
    head = C(cases.dense_head)
    _run(pools, head, (4, 3, 6, 5, 4), (2, 2, 1))
