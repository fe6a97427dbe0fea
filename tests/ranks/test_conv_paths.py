"""The shell convolution (blocking and overlapped) and per-block recomputation change no number.

Every conv case of tests/ranks/test_layers.py runs again in float64, with the halo exchange
blocking and overlapped, against torch.nn (the layer tests run the default path in
float32), and must have taken the shell path (the block convolved in place, the halos'
contributions added; no window formed); and again on the window path (block and halos
copied, one convolution), and on the timed choice between them (``conv_path="auto"``). Recomputation is compared with none.
"""

import math

import pytest
from test_layers import CONV

import overlap_cases

MODES = [(c, overlap) for c in CONV for overlap in (False, True)]


@pytest.mark.parametrize("case,overlap", MODES, ids=[f"{c[0]}-{'overlap' if o else 'blocking'}" for c, o in MODES])
def test_shell_conv_equals_serial_in_float64(pools, case, overlap):
    case_id, build, shape, spatial = case
    results = pools.run(math.prod(spatial), overlap_cases.conv_shell, build, shape, overlap, spatial=spatial)
    assert all(r["shell_taken"] for r in results), f"{case_id}: a rank fetched the whole window"
    for r in results:  # overlapped wherever messages travel (a 1-wide kernel or a local wrap sends none)
        assert r["overlapped"] == [overlap and t for t in r["talks"]], (case_id, r["overlapped"], r["talks"])


@pytest.mark.parametrize("case", CONV, ids=[c[0] for c in CONV])
def test_window_conv_equals_serial_in_float64(pools, case):
    """The window path (block and halos copied into one tensor, one convolution): output,
    input gradient and weight gradients equal torch.nn's on the gathered volume."""
    case_id, build, shape, spatial = case
    paths = pools.run(math.prod(spatial), overlap_cases.conv_path, build, shape, "window", spatial=spatial)
    assert all(p == ["window"] for p in paths), (case_id, paths)


@pytest.mark.parametrize("case", [CONV[2], CONV[17]], ids=[CONV[2][0], CONV[17][0]])
def test_auto_conv_path_equals_serial_and_respects_the_window_budget(pools, case):
    """``conv_path="auto"`` times both paths and takes one, alike on every rank; equal to
    torch.nn either way. A window budget of 0 bytes leaves only the shell, even where the
    window is asked for."""
    case_id, build, shape, spatial = case
    world = math.prod(spatial)
    paths = pools.run(world, overlap_cases.conv_path, build, shape, "auto", spatial=spatial)
    assert all(p == paths[0] for p in paths) and paths[0][0] in ("shell", "window"), (case_id, paths)
    paths = pools.run(world, overlap_cases.conv_path, build, shape, "window", 0, spatial=spatial)
    assert all(p == ["shell"] for p in paths), (case_id, paths)


@pytest.mark.parametrize("spatial,world", [((1, 1, 1), 1), ((1, 2, 1), 4)], ids=["serial", "data2-spatial2"])
def test_recompute_equals_no_recompute_with_dropout_and_batchnorm(pools, spatial, world):
    pools.run(world, overlap_cases.recompute_equals_plain, 0.3, True, spatial=spatial)


def test_unet_blocks_recomputed_equal_serial(pools):
    counts = pools.run(2, overlap_cases.unet_recompute_blocks, spatial=(2, 1, 1))
    assert counts[0] == 2 + 2 * 2 + 2  # input block's 2 conv blocks, 2 per level down, 2 up blocks


# (id, global shape, {tensor dim: every position's window}, mode, spatial split)
SHELLS = [
    ("D2-halo1", (1, 2, 8, 3, 3), {2: [(-1, 5), (3, 9)]}, "constant", (2, 1, 1)),
    ("D2-circular", (1, 2, 8, 3, 3), {2: [(-2, 5), (3, 10)]}, "circular", (2, 1, 1)),
    ("W4-halo-wider-than-block", (1, 1, 3, 3, 9), {4: [(-2, 5), (1, 7), (3, 9), (5, 11)]}, "constant", (1, 1, 4)),
    ("D2xH2-corners", (1, 2, 6, 5, 3), {2: [(-1, 4), (2, 7)], 3: [(-1, 4), (2, 6)]}, "constant", (2, 2, 1)),
    ("D2xH2xW2-trimmed", (1, 1, 6, 6, 7), {2: [(-1, 4), (2, 7)], 3: [(1, 3), (3, 5)], 4: [(-2, 5), (2, 9)]},
     "circular", (2, 2, 2)),
]


@pytest.mark.parametrize("shape,windows,mode,spatial", [c[1:] for c in SHELLS], ids=[c[0] for c in SHELLS])
def test_shell_exchange_builds_the_window_and_is_its_adjoint(pools, shape, windows, mode, spatial):
    pools.run(math.prod(spatial), overlap_cases.shell_adjoint, shape, windows, mode, spatial=spatial)
