"""K-FAC's factors wider than ``max_factor_dim`` in one process: low rank plus diagonal and
the hierarchical form at full rank against dense K-FAC, their state, the cost script."""

import io
import logging

import pytest
import torch
from torch import nn

import kfac_cases
from parallel.kfac import KFAC, KFACConfig


def _step(model, opt, x, y):
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _close(a, b):
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def test_low_rank_factors_at_full_rank_equal_dense_kfac(caplog):
    # Six of seven layers held low rank (A of the convolutions and the Flatten+Linear, G of
    # the transposed conv) with rank >= width: the Nystrom form is then the factor itself and
    # the Woodbury solve the exact damped inverse, so the steps are the plain reference's.
    with caplog.at_level(logging.INFO, logger="parallel.kfac"):
        r = kfac_cases.check_steps(None, 5, kfac_cases.settings(max_factor_dim=20, rank=1000, oversample=0))
    assert len(r["layers"]) == 7 and r["moved"] > 1e-3
    assert "layer '11' (Linear): factor A is 193 wide > kfac.max_factor_dim 20: held as rank 193" in caplog.text
    assert "layer '6' (ConvTranspose3d): factor G is 81 wide" in caplog.text
    assert "no layer takes the plain update for its width (6 held low rank)" in caplog.text
    # the hierarchical form of the Flatten+Linear's A (2x2x2 blocks of its 3 x 4^3 input, dense)
    # at full rank is the factor too
    r = kfac_cases.check_steps(None, 3, kfac_cases.settings(max_factor_dim=20, rank=1000, oversample=0,
                                                            flat_blocks=[2, 2, 2]))
    assert len(r["layers"]) == 7
    # and the wide layers are really held low rank: at rank 8 the steps leave the reference
    with pytest.raises(AssertionError, match="step 0"):
        kfac_cases.check_steps(None, 1, kfac_cases.settings(max_factor_dim=20, rank=8, oversample=4))


@pytest.mark.parametrize("flat_blocks", [[], [2, 2, 1]], ids=["diagonal", "hierarchical"])
def test_low_rank_state_round_trips_and_resumes(flat_blocks):
    kw = dict(max_factor_dim=20, rank=12, oversample=4, flat_blocks=flat_blocks)
    m1, o1 = kfac_cases.model_and_opt(**kw)
    m2, o2 = kfac_cases.model_and_opt(**kw)
    for seed in (1, 2, 3):
        _step(m1, o1, *kfac_cases.sample_batch(seed))
    buf = io.BytesIO()
    torch.save({"model": m1.state_dict(), "optimizer": o1.state_dict()}, buf)
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    entry = state["optimizer"]["kfac"]["layers"]["11.weight"]
    if flat_blocks:  # the sketch and the 4 blocks' (48 wide) and the bias's triangles; each block's eigenbasis
        assert set(entry) == {"A", "G", "UA", "lA", "QA", "eA", "QG", "lG"}
        assert tuple(entry["A"].shape) == (193 * 17 + 4 * 48 * 49 // 2 + 1,) and entry["QA"].numel() == 4 * 48**2 + 1
    else:
        assert set(entry) == {"A", "G", "UA", "lA", "dA", "QG", "lG"}
        assert tuple(entry["A"].shape) == (193, 17)  # sketch | diagonal
    assert tuple(entry["UA"].shape) == (193, 12)
    m2.load_state_dict(state["model"])
    o2.load_state_dict(state["optimizer"])  # hierarchical: held until a forward shows the volume
    assert sorted(o2.pending) == (["11.weight"] if flat_blocks else [])
    for seed in (4, 5):  # step 4 uses the loaded low-rank forms and cores, step 5 recomputes them
        _step(m1, o1, *kfac_cases.sample_batch(seed))
        _step(m2, o2, *kfac_cases.sample_batch(seed))
    assert _same(m1, m2)
    if flat_blocks:
        return
    m3, o3 = kfac_cases.model_and_opt(max_factor_dim=20, rank=10, oversample=4)
    with pytest.raises(ValueError, match=r"'0.weight': A has shape \(55, 17\), but the layer needs \(55, 15\) "
                                         r"\(a low-rank factor: kfac.rank, kfac.oversample and kfac.flat_blocks as saved\)"):
        o3.load_state_dict(state["optimizer"])


def test_low_rank_cost_script_counts_linear_memory(capsys):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "kfac_lowrank.py"
    spec = importlib.util.spec_from_file_location("kfac_lowrank_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["cost", "--widths", "600", "6000", "--rank", "16", "--dense-up-to", "600"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["width"], r["rank"], r["sketch"]) for r in rows] == [(600, 16, 32), (6000, 16, 32)]
    assert rows[0]["dense_eigh_s"] > 0 and rows[1]["dense_eigh_s"] is None
    # memory grows linearly with the width (10x, less the cores' fixed share), dense quadratically
    ratio = rows[1]["lowrank_memory_bytes"] / rows[0]["lowrank_memory_bytes"]
    assert 7 < ratio <= 10 and rows[1]["dense_memory_bytes"] / rows[0]["dense_memory_bytes"] == 100


def test_hierarchical_form_solves_exactly_and_reduces_to_the_others():
    from parallel.kfac import lowrank
    from parallel.kfac.inverse import eigen, precondition

    gen = torch.Generator().manual_seed(0)
    d, n, damping = 48, 5, 1e-2
    x = torch.randn(300, d, dtype=torch.float64, generator=gen) * torch.linspace(1.0, 0.05, d, dtype=torch.float64)
    a = x.t() @ x / 300
    g = torch.randn(n, n + 2, dtype=torch.float64, generator=gen)
    eg = eigen(g @ g.t(), torch.float64)
    v = torch.randn(n, d, dtype=torch.float64, generator=gen)
    blocks = [torch.arange(0, 20), torch.arange(20, 44), torch.arange(44, 48)]  # spatial blocks, uneven

    def form(rank, index):
        om = lowrank.omega("h", d, min(d, rank + 4), torch.float64, a.device)
        sketch = torch.cat([a @ om, a.diagonal()[:, None]], dim=1)
        f = lowrank.blocked(sketch, om, [(i, a[i][:, i]) for i in index], rank, torch.float64)
        return f, lowrank.blocked_precondition(v, f, eg, lowrank.blocked_cores(f, eg[1], damping), damping), (sketch, om)

    f, p, _ = form(8, blocks)
    h = f.u @ torch.diag(f.lam) @ f.u.t()  # the form assembled densely: Woodbury must solve it exactly
    for i, q, e in zip(f.index, f.q, f.e):
        h[i[:, None], i[None, :]] += q @ torch.diag(e) @ q.t()
    torch.testing.assert_close(p, precondition(v, eigen(h, torch.float64), eg, damping), rtol=1e-10, atol=0)
    torch.testing.assert_close(h[:20, :20], a[:20, :20], rtol=1e-10, atol=1e-12)  # diagonal blocks exact
    # full rank: the factor itself, so dense K-FAC
    _, p_full, _ = form(d, blocks)
    dense = precondition(v, eigen(a, torch.float64), eg, damping)
    torch.testing.assert_close(p_full, dense, rtol=1e-8, atol=1e-8 * float(dense.abs().max()))
    # one index per block: the low-rank plus diagonal form
    _, p_diag, (sketch, om) = form(8, [torch.tensor([j]) for j in range(d)])
    low = lowrank.nystrom(sketch, om, 8, 0.0, torch.float64)
    torch.testing.assert_close(p_diag, lowrank.precondition(v, "A", low, eg, lowrank.cores(low, eg[1], damping),
                                                            damping), rtol=1e-12, atol=0)
    # blocks carry more of the factor than the diagonal: closer to dense at the same rank
    assert float((p - dense).norm()) < float((p_diag - dense).norm())


def test_wide_output_factors_at_full_rank_equal_dense_and_rank_tol_drops():
    # G held low rank: a convolution with 30 output channels (channel sketches of the output
    # gradient) and a Linear with 25 outputs (sketches of its gradient rows); A of a 1x1x1
    # convolution and of a Linear beside them.
    def run(**kw):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv3d(2, 30, 1), nn.Tanh(), nn.Conv3d(30, 3, 1), nn.AvgPool3d(4), nn.Flatten(),
                              nn.Linear(6, 25), nn.Tanh(), nn.Linear(25, 3)).double()
        opt = KFAC(model, None, KFACConfig(**{**kfac_cases.settings(), "factor_dtype": "float64", **kw}), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            opt.zero_grad()
            x = torch.randn(3, 2, 4, 4, 8, dtype=torch.float64, generator=gen)
            ((model(x) - torch.randn(3, 3, dtype=torch.float64, generator=gen)) ** 2).mean().backward()
            opt.step()
        return model, opt

    dense, _ = run()
    full, opt = run(max_factor_dim=20, rank=100, oversample=0)
    assert {k: v["factor"] for k, v in opt.report()["low_rank"].items()} == {"0": "G", "2": "A", "5": "G", "7": "A"}
    with torch.no_grad():
        assert _close(dense, full) < 1e-10 * max(float(p.abs().max()) for p in dense.parameters())
    _, cut = run(max_factor_dim=20, rank=100, oversample=0, rank_tol=0.5)
    assert all(v["kept"] < v["rank"] for v in cut.report()["low_rank"].values())


def test_blocks_stay_on_their_ranks_only_where_they_refine_the_grid():
    """parallel.kfac.local: each of kfac.flat_blocks' blocks must lie inside one rank's block."""
    from parallel.kfac.local import refines

    assert refines([2, 2, 1], [2, 1, 1], [4, 4, 4]) and refines([2, 2, 1], [2, 2, 1], [4, 4, 4])
    assert refines([5, 1, 1], [2, 1, 1], [7, 4, 4])  # D 7: the grid cuts at 4, the blocks at 2, 4, 5, 6
    assert not refines([1, 2, 1], [2, 1, 1], [4, 4, 4]) and not refines([2, 2, 1], [1, 1, 2], [4, 4, 4])
    assert not refines([3, 1, 1], [2, 1, 1], [7, 4, 4])  # blocks cut at 3 and 5, the grid at 4
    assert not refines([4, 1, 1], [8, 1, 1], [4, 4, 4])  # the grid cannot split 4 voxels 8 ways
