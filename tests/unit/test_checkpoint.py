"""The checkpoint files (``parallel/job/checkpoint.py``): written atomically, loaded with
weights_only, the RNG streams restored; the last k are kept and an unreadable newest one
falls back to an older readable one; a checkpoint whose record
does not match the job is refused, naming every field that differs. (Kills and resumes:
tests/launch/test_fail_checkpoint.py.)"""

import pytest
import torch

from parallel.grid import Grid
from parallel.job import checkpoint
from parallel.train.persist import rng, writer
from train_helpers import prepare


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare("cosmoflow", tmp_path_factory.mktemp("cosmo16"), 16, 16, 4)


def test_keep_last_k_and_fall_back_to_an_older_readable_one(tmp_path):
    grid = Grid((1, 1, 1), 1, 0)
    model = torch.nn.Linear(3, 2)
    path = checkpoint.checkpoint_path(tmp_path)
    for step in range(1, 5):
        with torch.no_grad():
            model.weight.fill_(step)
        writer.save(path, grid, {"model": model.state_dict(), "step": step}, keep=3)
    assert [p.name for p in checkpoint.kept(path.parent)] == [f"step_00000000{s}.pt" for s in (2, 3, 4)]
    # a damaged last.pt (written anew, so not the hard-linked newest step file)
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data[:100])
    with pytest.raises(checkpoint.CheckpointError, match=f"checkpoint {path} cannot be read"):
        checkpoint.load(path)
    ckpt, used = checkpoint.load_latest(path)
    assert used.name == "step_000000004.pt" and ckpt["step"] == 4 and float(ckpt["model"]["weight"][0, 0]) == 4.0
    for p in checkpoint.kept(path.parent):
        p.write_bytes(b"junk")
    with pytest.raises(checkpoint.CheckpointError, match="no readable checkpoint"):
        checkpoint.load_latest(path)


def test_checkpoint_meta_mismatch_names_every_field():
    ckpt = {"meta": {"family": "cosmoflow", "volume": [16, 16, 16],
                     "model": {"conv_filters": 4, "n_conv_blocks": 2, "dropout": 0.5}}}
    checkpoint.check_matches(ckpt, dict(ckpt["meta"]), "x.pt")
    want = {"family": "cosmoflow", "volume": [32, 32, 32], "model": {"conv_filters": 8, "n_conv_blocks": 2,
                                                                      "dropout": 0.5}}
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.check_matches(ckpt, want, "x.pt")
    text = str(info.value)
    assert "volume: checkpoint [16, 16, 16], this run [32, 32, 32]" in text
    assert "model.conv_filters: checkpoint 4, this run 8" in text and "n_conv_blocks" not in text


def test_checkpoint_is_atomic_and_weights_only(tmp_path):
    grid = Grid((1, 1, 1), 1, 0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Dropout(0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    path = checkpoint.checkpoint_path(tmp_path)
    torch.manual_seed(7)
    writer.save(path, grid, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3})
    expected = torch.rand(4)
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]  # no temporary left behind
    ckpt = checkpoint.load(path)  # weights_only=True inside
    assert ckpt["step"] == 3 and torch.equal(ckpt["model"]["0.weight"], model[0].weight)
    torch.manual_seed(0)
    assert rng.restore_rng(ckpt, grid, seed=0)
    assert torch.equal(torch.rand(4), expected)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        checkpoint.load(tmp_path / "missing.pt")
