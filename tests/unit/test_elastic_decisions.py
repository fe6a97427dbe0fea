"""The elastic run's rules, without processes (docs/failures.md "Elastic runs"): accumulation
keeps the global batch, a data axis that does not divide it stops with the numbers, a
restart resumes on its own and keeps its split while it divides the world, the re-grid
record, and the background writer's copy taken at the save. (The node that dies:
tests/launch/test_elastic.py.)"""

import pytest
import torch

from parallel.job import checkpoint
from parallel.train import elastic
from parallel.train.persist import writer


@pytest.mark.parametrize("data,micro,want", [(2, 2, 1), (1, 2, 2), (2, 1, 2), (4, 1, 1), (1, 1, 4), (4, 4, 1)])
def test_accumulation_keeps_the_global_batch_and_the_micro_batch(data, micro, want):
    assert elastic.accumulation(4, data, 1, micro) == want



def test_a_data_axis_that_does_not_divide_the_global_batch_stops_with_the_numbers():
    with pytest.raises(elastic.ElasticError, match=r"train.global_batch_size=4 cannot be split over 3 data groups"):
        elastic.accumulation(4, 3, 1, 1)



def test_a_restart_resumes_on_its_own(monkeypatch):

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert elastic.resumes(False, "x") is False
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert elastic.resumes(False, "x") is True



def test_the_background_writer_writes_a_copy_taken_at_the_save(tmp_path):
    from parallel.grid import Grid

    grid = Grid((1, 1, 1), 1, 0)
    model = torch.nn.Linear(3, 2)
    w = writer.Writer(background=True)
    path = checkpoint.checkpoint_path(tmp_path)
    with torch.no_grad():
        model.weight.fill_(1.0)
    w.save(path, grid, {"model": model.state_dict(), "step": 1})
    with torch.no_grad():
        model.weight.fill_(2.0)  # training goes on while the copy is written
    w.finish(grid)
    assert float(checkpoint.load(path)["model"]["weight"][0, 0]) == 1.0
    costs = w.costs()
    assert costs["written"] == 1 and costs["write_seconds"] > 0 and costs["background"]



def test_a_restart_keeps_the_split_while_it_divides_the_world_else_chooses_as_auto(monkeypatch):
    from types import SimpleNamespace

    spatial = [2, 1, 1]
    asked = []

    def auto(world):
        asked.append(world.world_size)
        return [1, 1, 1]

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert elastic.spatial_choice(spatial, auto) == [2, 1, 1]  # a first start: the config as it is
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    choose = elastic.spatial_choice(spatial, auto)
    assert list(choose(SimpleNamespace(world_size=2))) == [2, 1, 1] and asked == []
    assert list(choose(SimpleNamespace(world_size=3))) == [1, 1, 1] and asked == [3]



def test_regrid_records_each_session_and_refuses_what_cannot_continue(tmp_path, monkeypatch):
    from types import SimpleNamespace

    def job(accum: int = 1):
        return SimpleNamespace(global_batch_size=4, accum_steps=accum)

    def grid(world: int, data: int):  # rank 0 of a world that needs no collective to agree
        return SimpleNamespace(launcher="torchrun", rank=0, world_size=1, data_size=data, spatial=(world // data, 1, 1))

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = elastic.regrid(job(), str(tmp_path), grid(4, 2))
    assert first.micro_batch == 2 and first.current.accum_steps == 1
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    state = elastic.regrid(job(), str(tmp_path), grid(2, 1))
    assert state.current.accum_steps == 2 and [s.data for s in state.sessions] == [2, 1]
    assert state.event(6)["from"]["data"] == 2 and state.event(6)["step"] == 6
    with pytest.raises(elastic.ElasticError, match=r"global_batch_size=4 cannot be split over 3 data groups"):
        elastic.regrid(job(), str(tmp_path), grid(3, 3))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # not elastic: nothing recorded
    assert elastic.regrid(job(), str(tmp_path), grid(2, 1)) is None
