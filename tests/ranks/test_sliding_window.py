"""Sliding-window evaluation: the MLPerf procedure, split across the spatial group.

The mean Dice of a fixed model is the same at every grid, and equals the tests' own
serial implementation of the reference procedure (``sliding_cases.reference_dice``).
Cases of several shapes: one smaller than the window, remainders dropped (41 -> 40 at a
stride of 8) and kept (padded), uneven blocks of the kept case across ranks.
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

import sliding_cases
from parallel.infer import importance_map, kept_range, plan_windows
from parallel.infer.windows import coverage_1d, importance_factors

WINDOW = 16
SHAPES = [(12, 20, 17), (30, 24, 41), (16, 16, 16), (21, 35, 22)]
GRIDS = [(1, [1, 1, 1]), (2, [2, 1, 1]), (4, [2, 2, 1]), (4, [2, 1, 1])]  # the last: data 2 x spatial 2


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("cases")
    return [str(p) for p in sliding_cases.write_cases(root, SHAPES)]


@pytest.fixture(scope="module")
def scores(cases: list[str]) -> list[float]:
    model = sliding_cases.small_unet()
    out = []
    for path in cases:
        with h5py.File(path, "r") as f:
            out.append(sliding_cases.reference_dice(model, f["image"][0], f["label"][0], WINDOW))
    assert 0.05 < np.mean(out) < 0.95, out  # neither trivial nor degenerate
    return out


@pytest.fixture(scope="module")
def reference(scores: list[float]) -> float:
    return float(np.mean(scores))


@pytest.mark.parametrize("world,spatial", GRIDS, ids=["1x1x1", "2x1x1", "2x2x1", "data2-2x1x1"])
def test_sliding_window_dice_is_the_reference_at_every_grid(pools, cases, reference, world, spatial):
    got = pools.run(world, sliding_cases.sliding_dice, cases, WINDOW, spatial=spatial, timeout=300)
    for value in got:
        assert value == pytest.approx(reference, abs=1e-5)


def test_averaging_data_groups_means_as_the_reference_does(pools, cases, scores):
    """3 cases over 2 data groups: shares [0, 1] and [2] (np.array_split, as the reference
    deals its evaluation cases); ``groups`` averages the two shares' means, ``cases`` all three."""
    three = cases[:3]
    got = pools.run(2, sliding_cases.sliding_dice, three, WINDOW, "sliding", "groups", spatial=[1, 1, 1])
    want = ((scores[0] + scores[1]) / 2 + scores[2]) / 2
    assert all(v == pytest.approx(want, abs=1e-5) for v in got)
    assert abs(want - np.mean(scores[:3])) > 1e-4  # the two averages differ here
    got = pools.run(2, sliding_cases.sliding_dice, three, WINDOW, "sliding", "cases", spatial=[1, 1, 1])
    assert all(v == pytest.approx(np.mean(scores[:3]), abs=1e-5) for v in got)


def test_whole_mode_is_one_pass_over_the_case(pools, tmp_path):
    files = [str(p) for p in sliding_cases.write_cases(tmp_path, [(16, 12, 20), (8, 16, 12)], seed=4)]
    want = sliding_cases.whole_dice_serial(files)
    for value in pools.run(2, sliding_cases.sliding_dice, files, WINDOW, "whole", spatial=[2, 1, 1]):
        assert value == pytest.approx(want, abs=1e-9)


def test_window_geometry_follows_the_reference():
    # stride 64: 200 % 64 = 8 < 32 is dropped (4 each side); 230 % 64 = 38 is kept, padded to 256
    assert kept_range((200, 230, 128), (128,) * 3) == ((4, 196), (0, 230), (0, 128))
    plan = plan_windows((192, 230, 100), (128,) * 3)
    assert plan.pad == ((0, 0), (13, 13), (14, 14)) and plan.padded == (192, 256, 128)
    assert plan.starts == ((0, 64), (0, 64, 128), (0,))
    with pytest.raises(ValueError, match="do not tile"):
        plan_windows((100, 100, 100), (128,) * 3, overlap=0.25)


def test_importance_map_is_the_cube_root_of_the_gaussian_product():
    w = 128
    k = np.arange(w) - (w - 1) / 2
    g = np.exp(-0.5 * (k / (0.125 * w)) ** 2)
    want = np.cbrt(np.outer(np.outer(g, g), g).reshape(w, w, w))
    want /= want.max()
    torch.testing.assert_close(importance_map((w,) * 3), torch.from_numpy(want), rtol=1e-12, atol=1e-15)
    # the cube root makes each axis a Gaussian of sigma 0.125 w sqrt(3)
    f = importance_factors((w,) * 3)[0].numpy()
    sigma = 0.125 * w * np.sqrt(3)
    np.testing.assert_allclose(f, np.exp(-0.5 * (k / sigma) ** 2) / np.exp(-0.5 * (0.5 / sigma) ** 2), rtol=1e-12)


def test_the_separable_normalisation_equals_the_summed_maps():
    plan = plan_windows((40, 24, 16), (16,) * 3)
    full = torch.zeros(plan.padded, dtype=torch.float64)
    cube = importance_map(plan.window)
    for d, h, w in plan.origins():
        full[d:d + 16, h:h + 16, w:w + 16] += cube
    (a, _), (b, _), (c, _) = plan.pad
    want = full[a:a + 40, b:b + 24, c:c + 16]
    f = importance_factors(plan.window)
    parts = [coverage_1d(plan, i, f[i], 0, n) for i, n in enumerate(plan.kept)]
    got = parts[0][:, None, None] * parts[1][None, :, None] * parts[2][None, None, :]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
