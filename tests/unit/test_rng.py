"""RNG streams on resume: restored from a checkpoint loaded to another device through
``map_location``, and a foreign layout reseeded deterministically with a warning
(parallel/train/persist/rng.py ``set_rng_state``/``restore_rng``)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from parallel import Grid
from parallel.job import checkpoint
from parallel.train.persist import rng, writer

GRID = Grid((1, 1, 1), 1, 0)


class _WithGenerators(nn.Module):
    """A model whose layer owns private generators, as the spatial dropout layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.group_generator = torch.Generator().manual_seed(11)
        self.rank_generator = torch.Generator().manual_seed(12)


def _saved(tmp_path, model=None):
    """A checkpoint written at step 4, and the draws that follow the save on each stream."""
    path = checkpoint.checkpoint_path(tmp_path)
    torch.manual_seed(3)
    writer.save(path, GRID, {"model": {}, "step": 4}, model)
    after = [torch.rand(3)]
    if model is not None:
        after += [torch.rand(3, generator=model.group_generator), torch.rand(3, generator=model.rank_generator)]
    return path, after


def _draws(model=None):
    out = [torch.rand(3)]
    if model is not None:
        out += [torch.rand(3, generator=model.group_generator), torch.rand(3, generator=model.rank_generator)]
    return out


def _reseeded_draw() -> torch.Tensor:
    torch.manual_seed(0 + 7919 * (4 + 1) + GRID.rank)  # what restore_rng documents
    return torch.rand(3)


def test_restored_on_the_cpu_continues_every_stream(tmp_path):
    model = _WithGenerators()
    path, after = _saved(tmp_path, model)
    torch.manual_seed(99)
    model.group_generator.manual_seed(1)
    assert rng.restore_rng(checkpoint.load(path, map_location="cpu"), GRID, seed=0, model=model)
    for got, want in zip(_draws(model), after):
        assert torch.equal(got, want)


def test_loaded_to_another_device_reseeds_with_a_warning(tmp_path, caplog):
    """A checkpoint read with map_location onto a device whose bytes cannot come back (here
    the meta device, the one other device a CPU-only machine has) reseeds, never raises."""
    path, _ = _saved(tmp_path)
    ckpt = checkpoint.load(path, map_location="meta")
    assert ckpt["rng"]["states"].device.type == "meta"
    with caplog.at_level(logging.WARNING, logger="parallel.train"):
        assert not rng.restore_rng(ckpt, GRID, seed=0)
    assert "do not fit this process" in caplog.text and "holds no bytes" in caplog.text
    assert torch.equal(torch.rand(3), _reseeded_draw())


@pytest.mark.parametrize("mangle,message", [
    (lambda s: s.float(), "torch.float32"),                                 # another format
    (lambda s: torch.cat([s, torch.zeros(s.shape[0], 16, dtype=torch.uint8)], 1),
     "this process's streams take"),                                        # a CUDA stream saved, none here
    (lambda s: s[:, :100], "holds 100 bytes"),                              # a CPU checkpoint on a GPU: too short
    (lambda s: s[0], "not a flat uint8 tensor"),                            # the per-rank stack lost
], ids=["float-bytes", "cuda-stream-extra", "too-short", "wrong-shape"])
def test_foreign_layout_reseeds_deterministically(tmp_path, caplog, mangle, message):
    path, after = _saved(tmp_path)
    ckpt = checkpoint.load(path)
    ckpt["rng"]["states"] = mangle(ckpt["rng"]["states"])
    draws = []
    for _ in range(2):
        torch.manual_seed(1234)
        with caplog.at_level(logging.WARNING, logger="parallel.train"):
            assert not rng.restore_rng(ckpt, GRID, seed=0)
        draws.append(torch.rand(3))
    assert message in caplog.text
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[0], _reseeded_draw())
    assert not torch.equal(draws[0], after[0])  # reseeded, not restored


def test_a_bad_layout_sets_no_stream_half_way(tmp_path):
    model = _WithGenerators()
    path, _ = _saved(tmp_path, model)
    state = checkpoint.load(path)["rng"]["states"][0]
    before = [torch.get_rng_state(), model.group_generator.get_state()]
    with pytest.raises(rng.RngLayoutError, match="dropout generator"):
        rng.set_rng_state(state[:-1], model)
    assert torch.equal(torch.get_rng_state(), before[0]) and torch.equal(model.group_generator.get_state(), before[1])
