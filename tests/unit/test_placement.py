"""Node-aware placement (parallel/placement.py): which node holds which ranks, whether
spatial groups stay inside a node, and the threads per rank. Pure logic, no processes
(the runtime gather is exercised by the launcher tests in test_cluster_scripts.py)."""

import pytest

from parallel.placement import Placement, _ranges, main, plan, threads_per_rank


def test_block_plan_keeps_each_spatial_group_on_one_node():
    p = plan(nodes=2, ranks_per_node=4, spatial=(2, 2, 1))
    assert p.nodes == ["node0", "node1"]
    assert [p.nodes_of(g) for g in p.spatial_groups] == [["node0"], ["node1"]]
    assert [len(p.nodes_of(g)) for g in p.data_groups] == [2, 2, 2, 2]  # data groups across nodes
    assert p.split_groups == [] and p.block and p.warnings() == []
    assert "2/2 spatial groups of 4 within one node" in p.describe()
    assert "node0: ranks 0-3; node1: ranks 4-7" in p.describe()


def test_group_larger_than_a_node_spans_the_fewest_nodes():
    p = plan(nodes=4, ranks_per_node=2, spatial=(4, 1, 1))
    assert p.min_nodes_per_group == 2
    assert [len(p.nodes_of(g)) for g in p.spatial_groups] == [2, 2]
    assert p.warnings() == []


@pytest.mark.parametrize("hosts,split", [
    pytest.param(("a", "b", "a", "b"), [0, 1], id="cyclic-splits-groups"),
    pytest.param(("a", "a", "a", "b", "b", "b"), [1], id="3-per-node-groups-of-2"),
])
def test_groups_split_across_nodes_are_reported(hosts, split):
    p = Placement(hosts, 2)
    assert p.split_groups == split
    (message,) = p.warnings()
    assert "span more than 1 node(s)" in message and "--distribution=block" in message


def test_cyclic_placement_that_still_fits_is_noted():
    p = Placement(("a", "a", "b", "b", "a", "a", "b", "b"), 2)
    assert p.split_groups == [] and not p.block
    assert "not consecutive" in p.warnings()[0]


def test_plan_rejects_a_world_that_is_not_whole_spatial_groups():
    with pytest.raises(ValueError, match=r"6 ranks is not a multiple of the spatial group size 2x2x1 = 4"):
        plan(nodes=3, ranks_per_node=2, spatial=(2, 2, 1))


def test_threads_per_rank_never_oversubscribe():
    assert threads_per_rank(64, 16) == 4
    assert threads_per_rank(112, 8) == 14
    assert threads_per_rank(2, 4) == 1  # more ranks than cores: one thread each


def test_ranges():
    assert _ranges([0, 1, 2, 5, 7, 8]) == "ranks 0-2,5,7-8"


def test_cli(capsys):
    assert main(["--nodes", "2", "--ranks-per-node", "8", "--spatial", "2", "2", "2", "--cores-per-node", "64"]) == 0
    out = capsys.readouterr().out
    assert "16 ranks on 2 node(s)" in out and "threads per rank: 8" in out
    assert main(["--nodes", "1", "--ranks-per-node", "3", "--spatial", "2", "1", "1"]) == 2
