"""Cheaper K-FAC factor updates in one process: subsampled positions against the patches
picked by hand, the interval chosen from the factors' measured change (and resumed), Gram
products in bfloat16 against float64, and the planner's count of the cut."""

import io

import pytest
import torch
from torch import nn

import kfac_cases
from parallel.kfac import KFACConfig, kfac_costs
from parallel.kfac.patches import pad_volume, patch_gram, patch_view
from parallel.kfac.subsample import Staleness, ladder, sampled_window


def _by_hand(x, conv, every, origin):
    """The mean of a a^T over the output positions whose global coordinate (origin + local
    index) is a multiple of ``every`` in each dim, a = (patch, 1), from the whole patch view."""
    v = patch_view(x, conv.kernel_size, conv.stride, conv.dilation)  # (N, C, Do, Ho, Wo, kd, kh, kw)
    keep = [[j for j in range(v.shape[2 + a]) if (origin[a] + j) % every == 0] for a in range(3)]
    v = v[:, :, keep[0]][:, :, :, keep[1]][:, :, :, :, keep[2]]
    rows = v.permute(0, 2, 3, 4, 1, 5, 6, 7).reshape(-1, v.shape[1] * v[0, 0, 0, 0, 0].numel())
    rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
    return rows.t() @ rows / rows.shape[0], rows.shape[0]


def test_subsampled_positions_are_the_global_multiples_of_the_stride():
    torch.manual_seed(0)
    conv = nn.Conv3d(2, 3, 3, stride=2, padding=1, dilation=(1, 2, 1)).double()
    x = pad_volume(torch.randn(2, 2, 13, 14, 11, dtype=torch.float64), [(1, 1), (2, 2), (1, 1)])
    for origin in [(0, 0, 0), (4, 1, 5), (2, 3, 1)]:  # a block's first output at these global coordinates
        want, n = _by_hand(x, conv, 3, origin)
        view, stride = sampled_window(x, conv.kernel_size, conv.stride, conv.dilation, origin, 3)
        got, count = patch_gram(view, conv.kernel_size, stride, conv.dilation, True, torch.float64, 2**16)
        assert count == n and 0 < n < 2 * 7 * 7 * 6
        torch.testing.assert_close(got / count, want, rtol=1e-13, atol=1e-13)
    # a block with no sampled position along a dim (output length 1, first sample at 2)
    assert sampled_window(x[:, :, :3], conv.kernel_size, conv.stride, conv.dilation, (1, 0, 0), 3) is None


def test_position_stride_subsamples_only_a_convolutions_a():
    x, y = kfac_cases.sample_batch(1)
    full = kfac_cases.model_and_opt()
    cheap = kfac_cases.model_and_opt(position_stride=2)
    for model, opt in (full, cheap):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    for layer in full[1].layers:
        (a1, g1), (a2, g2) = full[1].factors[layer.key], cheap[1].factors[layer.key]
        if layer.kind == "conv":
            assert not torch.allclose(a1, a2) and torch.equal(g1, g2)
            # still the mean of a a^T over patches: the bias entry (the 1 x 1 term) is exactly 1
            assert float(a2[-1, -1]) == 1.0
        else:
            assert torch.equal(a1, a2) and torch.equal(g1, g2)
    # the first conv (8^3 outputs, padding 1) by hand: the even positions of 8 in each dim
    conv = cheap[0][0]
    want, n = _by_hand(pad_volume(x, [(1, 1)] * 3), conv, 2, (0, 0, 0))
    assert n == 4 * 4**3
    torch.testing.assert_close(cheap[1].factors["0.weight"][0], want, rtol=1e-13, atol=1e-13)


def test_stale_tol_lengthens_the_interval_and_resume_keeps_it():
    assert ladder(2, 10, 0) == [2, 10] and ladder(10, 100, 50) == [10, 20, 50] and ladder(1, 4, 0) == [1, 2, 4]
    s = Staleness(1, 4, 0.1, 0)
    for step, change, want in [(0, None, 1), (1, 0.05, 2), (2, 0.15, 2), (4, 0.01, 4), (8, 0.3, 2)]:
        s.observe(step, change)
        assert s.interval == want, (step, change)
    # in the optimiser: a tolerance every change stays below moves 1 -> 2 -> 4 (captures at 0, 1, 2, 4)
    model, opt = kfac_cases.model_and_opt(factor_interval=1, inverse_interval=4, stale_tol=10.0)
    _, other = kfac_cases.model_and_opt(factor_interval=1, inverse_interval=4, stale_tol=10.0)
    captured = []
    for seed in range(1, 6):
        x, y = kfac_cases.sample_batch(seed)
        captured.append(opt.captures(opt.steps))
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        if seed == 3:  # resume after step 2: the interval (2, chosen at step 2 -> 4) travels with the state
            buf = io.BytesIO()
            torch.save({"optimizer": opt.state_dict()}, buf)
            other.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True)["optimizer"])
            assert other.staleness.interval == opt.staleness.interval == 4
    assert captured == [True, True, True, False, True]
    report = opt.report()["staleness"]
    assert report["interval"] == 4 and report["updates"] == 4 and len(report["history"]) == 3
    assert all(0 < c < 1 for _, c, _ in report["history"])
    # off (the default): the change is measured and reported, the interval never moves
    model, opt = kfac_cases.model_and_opt(factor_interval=1, inverse_interval=4)
    for seed in range(1, 3):
        x, y = kfac_cases.sample_batch(seed)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    assert opt.staleness.interval == 1 and len(opt.report()["staleness"]["history"]) == 1


def test_bf16_gram_products_are_close_to_float64():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 12, 12, 12, dtype=torch.float64).abs()  # post-ReLU-like: a large mean
    exact, _ = patch_gram(x, (3, 3, 3), (1, 1, 1), (1, 1, 1), True, torch.float64, 2**20)
    low, _ = patch_gram(x, (3, 3, 3), (1, 1, 1), (1, 1, 1), True, torch.float32, 2**20, torch.bfloat16)
    assert low.dtype == torch.float32
    err = float((low.double() - exact).norm() / exact.norm())
    assert 1e-5 < err < 1e-2
    assert float(low[-1, -1]) == exact[-1, -1]  # the count is exact
    with pytest.raises(ValueError, match="gram_dtype=float16"):
        KFACConfig(gram_dtype="float16").validate()


def test_costs_count_the_subsampled_positions():
    torch.manual_seed(0)
    model = kfac_cases.build()
    full = kfac_costs(model, kfac_cases.SHAPE, KFACConfig())
    cheap = kfac_costs(model, kfac_cases.SHAPE, KFACConfig(position_stride=2))
    by = {layer["name"]: layer for layer in cheap.layers}
    for layer in full.layers:
        if layer["kind"] == "conv":
            assert by[layer["name"]]["factor_flops"] < layer["factor_flops"] / 2
        else:
            assert by[layer["name"]]["factor_flops"] == layer["factor_flops"]
    assert cheap.factor_allreduce_bytes == full.factor_allreduce_bytes


def test_position_stride_sketches_the_same_patches():
    # A low-rank A (max_factor_dim 20) is sketched from the same subsampled patches: its
    # running [A Omega | diag(A)] is the dense subsampled A's.
    x, y = kfac_cases.sample_batch(1)
    dense = kfac_cases.model_and_opt(position_stride=2)
    low = kfac_cases.model_and_opt(position_stride=2, max_factor_dim=20, rank=12, oversample=4)
    for model, opt in (dense, low):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    convs = [layer for layer in low[1].layers if layer.kind == "conv" and layer.wide == "A"]
    assert len(convs) == 4
    for layer in convs:
        a, sketch = dense[1].factors[layer.key][0], low[1].factors[layer.key][0]
        torch.testing.assert_close(sketch, torch.cat([a @ layer.omega, a.diagonal()[:, None]], dim=1),
                                   rtol=1e-12, atol=1e-12)
