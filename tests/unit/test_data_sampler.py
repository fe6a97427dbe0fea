"""Samplers: one global shuffle per epoch, disjoint shards, the same order in a spatial group."""

from __future__ import annotations

import numpy as np
import pytest

from parallel.data import GlobalShuffleSampler, PartialShuffleSampler, ShardSampler
from parallel.grid import Grid


def _epoch(n: int, spatial: tuple[int, int, int], world: int, batch: int, epoch: int, **kw) -> dict[int, list[list[int]]]:
    """Every rank's steps of one epoch."""
    out = {}
    for r in range(world):
        s = GlobalShuffleSampler(n, Grid(spatial=spatial, world_size=world, rank=r), batch, **kw)
        s.set_epoch(epoch)
        out[r] = list(s)
    return out


@pytest.mark.parametrize("world,spatial", [(1, (1, 1, 1)), (4, (1, 1, 1)), (8, (2, 1, 1)), (6, (1, 1, 3))],
                         ids=["serial", "data4", "data4-spatial2", "data2-spatial3"])
def test_global_shuffle_shards_are_disjoint_and_cover_the_epoch(world: int, spatial: tuple[int, int, int]) -> None:
    n, batch = 40, 8
    steps = _epoch(n, spatial, world, batch, epoch=2, seed=5)
    grids = [Grid(spatial=spatial, world_size=world, rank=r) for r in range(world)]
    for g in grids:  # every rank of a spatial group: the same samples, the same order
        assert steps[g.rank] == steps[g.data_rank * g.spatial_size]
    seen = [i for g in grids if g.spatial_rank == 0 for step in steps[g.rank] for i in step]
    assert sorted(seen) == list(range(n))


def test_the_global_batch_does_not_depend_on_the_data_parallel_size() -> None:
    n, batch = 50, 8
    reference = _epoch(n, (1, 1, 1), 1, batch, epoch=3, seed=11)[0]
    for world in (2, 4, 8):
        steps = _epoch(n, (1, 1, 1), world, batch, epoch=3, seed=11)
        for k, rows in enumerate(reference):
            joined = [i for r in range(world) for i in steps[r][k]]
            assert joined == rows, (world, k)


def test_epochs_and_seeds_reshuffle_deterministically() -> None:
    a = _epoch(64, (1, 1, 1), 2, 8, epoch=0, seed=1)
    assert a == _epoch(64, (1, 1, 1), 2, 8, epoch=0, seed=1)
    assert a != _epoch(64, (1, 1, 1), 2, 8, epoch=1, seed=1)
    assert a != _epoch(64, (1, 1, 1), 2, 8, epoch=0, seed=2)
    ordered = _epoch(16, (1, 1, 1), 1, 4, epoch=0, shuffle=False)[0]
    assert ordered == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def test_tail_without_drop_last_reaches_every_sample_and_every_rank_steps() -> None:
    n, batch, world = 11, 4, 4
    steps = _epoch(n, (1, 1, 1), world, batch, epoch=0, seed=0, drop_last=False)
    assert {len(s) for s in steps.values()} == {3}  # same step count everywhere (collectives)
    assert sorted(i for s in steps.values() for step in s for i in step) == list(range(n))
    assert [len(steps[r][-1]) for r in range(world)] == [1, 1, 1, 0]


def test_resume_mid_epoch_from_state_dict() -> None:
    grid = Grid(spatial=(1, 1, 1), world_size=2, rank=1)
    s = GlobalShuffleSampler(40, grid, 8, seed=4)
    s.set_epoch(3)
    full = list(s)
    state = {**s.state_dict(), "step": 2}
    t = GlobalShuffleSampler(40, grid, 8, seed=4)
    t.load_state_dict(state)
    assert t.epoch == 3 and list(t) == full[2:]


@pytest.mark.parametrize("exchange", [0.0, 0.25, 1.0])
def test_partial_shuffle_exchanges_the_asked_fraction(exchange: float) -> None:
    n, world, batch = 103, 4, 8
    samplers = [PartialShuffleSampler(n, Grid(spatial=(1, 1, 1), world_size=world, rank=r), batch,
                                      seed=9, exchange=exchange) for r in range(world)]
    assert len({len(s) for s in samplers}) == 1
    for epoch in range(4):
        shards = samplers[0].shards(epoch)
        assert sorted(np.concatenate(shards).tolist()) == list(range(n))  # disjoint, complete
        sizes = [len(x) for x in shards]
        assert max(sizes) - min(sizes) <= 1
        for r, s in enumerate(samplers):
            s.set_epoch(epoch)
            steps = list(s)
            drawn = [i for step in steps for i in step]
            assert set(drawn) <= set(shards[r].tolist()) and len(drawn) == len(set(drawn))
        if epoch:
            for r in range(world):
                kept = len(np.intersect1d(shards[r], samplers[0].shards(epoch - 1)[r]))
                moved = round(exchange * len(shards[r]))
                assert kept >= len(shards[r]) - moved
                np.testing.assert_array_equal(samplers[r].incoming(epoch),
                                              np.setdiff1d(shards[r], samplers[0].shards(epoch - 1)[r]))
                if exchange == 0:
                    assert kept == len(shards[r])
            if exchange >= 0.25:
                assert sum(len(samplers[r].incoming(epoch)) for r in range(world)) >= 0.5 * exchange * n


def test_partial_shuffle_is_deterministic_and_reorders_each_epoch() -> None:
    g = Grid(spatial=(2, 1, 1), world_size=4, rank=3)
    a, b = (PartialShuffleSampler(64, g, 8, seed=1, exchange=0.2) for _ in range(2))
    b.shards(5)  # a warm cache must not change the answer for an earlier epoch
    for e in (0, 1, 2):
        a.set_epoch(e)
        b.set_epoch(e)
        assert list(a) == list(b)
    a.set_epoch(1)
    first = list(a)
    a.set_epoch(2)
    assert list(a) != first


@pytest.mark.parametrize("n,data,per_step", [(42, 8, 1), (42, 8, 4), (5, 2, 1), (3, 4, 1)])
def test_shard_sampler_deals_contiguous_shares_like_array_split(n: int, data: int, per_step: int) -> None:
    """Evaluation: data group r takes np.array_split's r-th share, every group the same steps."""
    spatial = (2, 1, 1)
    world = data * 2
    shares = np.array_split(np.arange(n), data)
    steps = None
    for r in range(world):
        grid = Grid(spatial=spatial, world_size=world, rank=r)
        got = list(ShardSampler(n, grid, per_step=per_step))
        steps = steps or len(got)
        assert len(got) == steps == -(-max(len(s) for s in shares) // per_step)
        assert [i for step in got for i in step] == shares[grid.data_rank].tolist()
        assert all(len(step) <= per_step for step in got)
