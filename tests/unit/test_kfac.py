"""K-FAC in one process: the serial step against the plain reference, what is captured
when, the settings, the layer choice, the work assignment, the state and the costs."""

import copy
import io
import logging
import random

import pytest
import torch
from torch import nn

import kfac_cases
from parallel.grid import Grid
from parallel.kfac import KFAC, KFACConfig, kfac_costs
from parallel.kfac.inverse import assign, loads
from parallel.kfac.patches import patch_gram


@pytest.mark.parametrize("name", ["main", "unet", "serial"])
def test_serial_steps_equal_reference(name):
    r = kfac_cases.check_steps(None, 5, kfac_cases.settings(), name=name)
    assert r["moved"] > 1e-3 and min(r["nus"]) < 1.0


def test_grid_of_one_rank_equals_reference():
    r = kfac_cases.check_steps(Grid((1, 1, 1), 1, 0), 3, kfac_cases.settings())
    assert len(r["layers"]) == 7


def _step(model, opt, x, y, pieces=1):
    opt.zero_grad()
    for xm, ym in zip(torch.tensor_split(x, pieces), torch.tensor_split(y, pieces)):
        (((model(xm) - ym) ** 2).mean() / pieces).backward()
    opt.step()


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _close(a, b):
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def test_accumulated_micro_batches_equal_one_batch():
    m1, o1 = kfac_cases.model_and_opt()
    m2, o2 = kfac_cases.model_and_opt()
    for seed in (1, 2, 3):
        x, y = kfac_cases.sample_batch(seed)
        _step(m1, o1, x, y)
        _step(m2, o2, x, y, pieces=2)  # loss / accum per micro-batch, as the loop does
    assert _close(m1, m2) < 1e-12


def test_zero_grad_drops_statistics_of_a_step_not_taken():
    m1, o1 = kfac_cases.model_and_opt()
    m2, o2 = kfac_cases.model_and_opt()
    x, y = kfac_cases.sample_batch(1)
    o2.zero_grad()
    ((m2(x * 3) - y) ** 2).mean().backward()  # e.g. a step dropped for non-finite gradients
    _step(m1, o1, x, y)
    _step(m2, o2, x, y)
    assert _same(m1, m2)


def test_forwards_without_backward_or_in_eval_capture_nothing():
    m1, o1 = kfac_cases.model_and_opt()
    m2, o2 = kfac_cases.model_and_opt()
    x, y = kfac_cases.sample_batch(1)
    o2.zero_grad()
    m2(x * 2)  # a forward that no backward follows
    m2.eval()
    with torch.no_grad():
        m2(x * 5)
    m2.train()
    ((m2(x) - y) ** 2).mean().backward()
    o2.step()
    _step(m1, o1, x, y)
    assert _same(m1, m2)


def test_recomputed_blocks_give_the_same_steps():
    from parallel.model.recompute import checkpoint_blocks

    m1, o1 = kfac_cases.model_and_opt()
    m2, o2 = kfac_cases.model_and_opt()
    assert checkpoint_blocks(m2) > 0
    for seed in (1, 2):
        x, y = kfac_cases.sample_batch(seed)
        _step(m1, o1, x, y)
        _step(m2, o2, x, y)
    assert _close(m1, m2) < 1e-12


def test_a_deep_copy_of_the_model_captures_nothing_into_the_optimiser():
    m1, o1 = kfac_cases.model_and_opt()
    m2, o2 = kfac_cases.model_and_opt()
    twin = copy.deepcopy(m2)
    x, y = kfac_cases.sample_batch(1)
    o2.zero_grad()
    ((twin(x * 4) - y) ** 2).mean().backward()
    ((m2(x) - y) ** 2).mean().backward()
    o2.step()
    _step(m1, o1, x, y)
    assert _same(m1, m2)


def test_without_preconditioned_layers_it_is_sgd():
    torch.manual_seed(0)
    m1 = kfac_cases.build()
    m2 = copy.deepcopy(m1)
    o1 = KFAC(m1, None, KFACConfig(include=["nothing*"]), lr=0.1, momentum=0.9)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    assert o1.layers == []
    for seed in (1, 2):
        x, y = kfac_cases.sample_batch(seed)
        _step(m1, o1, x, y)
        _step(m2, o2, x, y)
    assert _same(m1, m2)


def test_fp16_grad_scale_is_taken_out_of_the_factors():
    m1, o1 = kfac_cases.model_and_opt()
    m2, o2 = kfac_cases.model_and_opt()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    o2.grad_scaler = scaler
    x, y = kfac_cases.sample_batch(1)
    _step(m1, o1, x, y)
    o2.zero_grad()
    scaler.scale(((m2(x) - y) ** 2).mean()).backward()
    scaler.step(o2)
    assert _close(m1, m2) < 1e-12


def test_linear_on_a_volume_is_refused_with_its_name():
    model = nn.Sequential(nn.Conv3d(2, 3, 1), nn.Linear(4, 2)).double()
    opt = KFAC(model, None, KFACConfig(), lr=0.1)
    with pytest.raises(ValueError, match=r"layer '1' \(Linear\) got a 5-D input.*kfac.exclude=\['1'\]"):
        model(torch.randn(1, 2, 3, 3, 4, dtype=torch.float64))
    assert len(opt.layers) == 2


@pytest.mark.parametrize("kw,match", [
    ({"damping": 0.0}, "kfac.damping must be > 0, got 0.0"),
    ({"factor_interval": 2, "inverse_interval": 3}, r"inverse_interval \(3\) must be a multiple of kfac.factor_interval \(2\)"),
    ({"factor_decay": 1.0}, r"factor_decay must be in \[0, 1\), got 1.0"),
    ({"kl_clip": -1.0}, "kl_clip must be >= 0"),
    ({"inverse_dtype": "bfloat16"}, "inverse_dtype must be float32, float64 or auto"),
    ({"factor_dtype": "int8"}, "kfac.factor_dtype must be one of"),
    ({"wide_factors": "dense"}, "kfac.wide_factors must be one of lowrank, plain, got 'dense'"),
    ({"rank": 0}, "kfac.rank must be >= 1 and kfac.oversample >= 0, got 0 and 16"),
    ({"rank_tol": 1.0}, r"kfac.rank_tol must be in \[0, 1\), got 1.0"),
    ({"flat_blocks": [2, 2]}, r"kfac.flat_blocks must be empty or three splits >= 1 \(D, H, W\), got \[2, 2\]"),
])
def test_bad_settings_name_the_setting(kw, match):
    with pytest.raises(ValueError, match=match):
        KFACConfig(**kw).validate()


def test_layer_choice_by_pattern_size_and_groups(caplog):
    model = nn.Sequential(nn.Conv3d(4, 4, 3, groups=2), nn.Conv3d(4, 8, 3), nn.Conv3d(8, 8, 1), nn.Flatten(),
                          nn.Linear(8, 2))
    with caplog.at_level(logging.INFO, logger="parallel.kfac"):
        opt = KFAC(model, None, KFACConfig(exclude=["4"], max_factor_dim=100, wide_factors="plain"), lr=0.1)
    assert [layer.name for layer in opt.layers] == ["2"]
    text = caplog.text
    assert "layer '0' takes the plain update (Conv3d: groups=2" in text
    assert ("layer '1' takes the plain update (Conv3d: factor A is 109 wide > kfac.max_factor_dim 100 "
            "(kfac.wide_factors=plain))") in text
    assert "layer '4' takes the plain update (Linear: matched by kfac.exclude '4')" in text
    only = KFAC(model, None, KFACConfig(include=["1", "4"]), lr=0.1)
    assert [layer.name for layer in only.layers] == ["1", "4"]


def test_assignment_is_balanced_and_deterministic():
    rng = random.Random(0)
    for ranks in (1, 2, 3, 8):
        costs = [rng.uniform(1, 100) ** 3 for _ in range(25)]
        owner = assign(costs, ranks)
        assert owner == assign(list(costs), ranks) and set(owner) <= set(range(ranks))
        load = loads(costs, owner, ranks)
        best_possible = max(sum(costs) / ranks, max(costs))
        assert max(load) <= (4 / 3) * best_possible  # the LPT rule's guarantee
    assert sorted(assign([5.0] * 8, 4)) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert assign([1.0, 1000.0, 2.0], 2) == [1, 0, 1]  # the big one alone


def test_patch_sums_in_chunks_equal_the_whole():
    x = torch.randn(2, 3, 9, 6, 7, dtype=torch.float64)
    whole, n = patch_gram(x, (3, 2, 3), (2, 1, 2), (1, 2, 1), True, torch.float64, 1e12)
    chunked, m = patch_gram(x, (3, 2, 3), (2, 1, 2), (1, 2, 1), True, torch.float64, 1.0)
    assert n == m == 2 * 4 * 4 * 3 and whole[-1, -1] == n
    # The same products summed in slabs: a few ulps of the largest entry apart.
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-13 * float(whole.abs().max()))


def test_state_round_trips_with_weights_only_and_resumes():
    m1, o1 = kfac_cases.model_and_opt()
    m2, o2 = kfac_cases.model_and_opt()
    for seed in (1, 2, 3):
        _step(m1, o1, *kfac_cases.sample_batch(seed))
    buf = io.BytesIO()
    torch.save({"model": m1.state_dict(), "optimizer": o1.state_dict()}, buf)
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    kf = state["optimizer"]["kfac"]
    assert kf["steps"] == 3 and sorted(kf["layers"]) == sorted(f"{layer.name}.weight" for layer in o1.layers)
    assert set(kf["layers"]["0.weight"]) == {"A", "G", "QA", "lA", "QG", "lG"}
    m2.load_state_dict(state["model"])
    o2.load_state_dict(state["optimizer"])
    for seed in (4, 5):
        _step(m1, o1, *kfac_cases.sample_batch(seed))
        _step(m2, o2, *kfac_cases.sample_batch(seed))
    assert _same(m1, m2)


def test_state_of_another_shape_or_from_sgd(caplog):
    m1, o1 = kfac_cases.model_and_opt()
    _step(m1, o1, *kfac_cases.sample_batch(1))
    state = o1.state_dict()
    state["kfac"]["layers"]["2.weight"]["A"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"kfac state of '2.weight': A has shape \(3, 3\), but the layer needs \(109, 109\)"):
        o1.load_state_dict(state)
    sgd = torch.optim.SGD(m1.parameters(), lr=0.1, momentum=0.9)
    with caplog.at_level(logging.WARNING, logger="parallel.kfac"):
        o1.load_state_dict(sgd.state_dict())
    assert "no K-FAC part" in caplog.text and o1.steps == 0 and o1.factors == {}


def test_costs_match_the_optimiser_and_spread_the_inverses():
    from cosmoflow.model import CosmoFlow, CosmoFlowConfig

    model, opt = kfac_cases.model_and_opt()
    costs = kfac_costs(model, kfac_cases.SHAPE, opt.cfg)
    assert [c["name"] for c in costs.layers] == [layer.name for layer in opt.layers]
    assert costs.linear_allreduce_bytes == 0 and costs.broadcast_bytes > 0
    assert [p.device.type for p in model.parameters()] == ["cpu"] * len(list(model.parameters()))
    cosmo = CosmoFlow(CosmoFlowConfig())
    one = kfac_costs(cosmo, (4, 4, 128, 128, 128), KFACConfig(), world_size=1)
    many = kfac_costs(cosmo, (4, 4, 128, 128, 128), KFACConfig(), spatial=(2, 1, 1), world_size=8)
    plain = kfac_costs(cosmo, (4, 4, 128, 128, 128), KFACConfig(wide_factors="plain"), world_size=1)
    assert any(name == "head.1" and "32769 wide" in why for name, why in plain.skipped)
    # by default the wide factors are held low rank: head.1's A (32769) and features.12's (6913)
    wide = {c["name"]: (c["low_rank"], c["rank"]) for c in one.layers if c["low_rank"]}
    assert wide == {"features.12": ("A", 128), "head.1": ("A", 128)} and not one.skipped
    assert plain.memory_bytes < one.memory_bytes < plain.memory_bytes + 2**30  # linear: ~0.1 GB more
    assert one.inverse_flops == one.inverse_flops_total > many.inverse_flops
    assert many.factor_flops < one.factor_flops and many.linear_allreduce_bytes > 0
    assert one.per_step()["inverse_flops"] == one.inverse_flops / one.inverse_interval


def test_auto_precision_follows_the_weights_and_explicit_settings_win():
    # train.precision=fp64 builds float64 weights: K-FAC's factors and inverses follow them
    # unless factor_dtype / inverse_dtype are set.
    model, opt = kfac_cases.model_and_opt(factor_dtype="auto", inverse_dtype="auto")
    assert (opt.factor_dtype, opt.inverse_dtype) == (torch.float64, torch.float64)
    _step(model, opt, *kfac_cases.sample_batch(1))
    assert all(t.dtype == torch.float64 for pair in opt.factors.values() for t in pair)
    assert all(t.dtype == torch.float64 for pair in opt.eigen.values() for e in pair for t in e)
    single = KFAC(kfac_cases.build().float(), None, KFACConfig(), lr=0.1)
    assert (single.factor_dtype, single.inverse_dtype) == (torch.float32, torch.float32)
    mixed = KFAC(kfac_cases.build(), None, KFACConfig(factor_dtype="float32"), lr=0.1)
    assert (mixed.factor_dtype, mixed.inverse_dtype) == (torch.float32, torch.float64)
