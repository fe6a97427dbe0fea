"""The replica check's parts without processes: the digest sees every flipped bit and
ulp drifts that cancel in a plain sum; the comparison names the odd rank of a majority,
both copies of a pair, and compares a sharded weight only over its data-group copies; the
fault hook's variable is parsed strictly. The check in real jobs:
tests/launch/test_replica_faults.py."""

import pytest
import torch

from parallel.job.errors import InputError
from parallel.train import faults, replicas


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", ["host", "device"])
def test_the_digest_changes_with_every_single_flipped_bit(dtype, path):
    torch.manual_seed(0)
    t = torch.randn(37, 5).to(dtype)
    fn = replicas.digest if path == "host" else (lambda x: tuple(replicas.device_sums(x.reshape(-1)).tolist()))
    ref = fn(t)
    assert fn(t.clone()) == ref
    for bit in range(8 * t.element_size()):
        for index in (0, 100, t.numel() - 1):
            u = t.clone()
            faults.flip_bit_(u, bit, index)
            assert fn(u) != ref, (bit, index)


def test_the_device_digest_sees_ulp_drifts_that_cancel_in_a_plain_sum():
    # one element one ulp up, another one ulp down: the words' sum is unchanged
    t = torch.randn(1000)
    u = t.clone()
    w = u.view(torch.int32)
    w[3] += 1
    w[500] -= 1
    a, b = replicas.device_sums(t), replicas.device_sums(u)
    assert a[0] == b[0] and a[1] != b[1]
    assert replicas.digest(t) != replicas.digest(u)


def _table(rows):
    return torch.tensor(rows, dtype=torch.int64)


def test_the_odd_rank_of_a_majority_is_named_and_a_pair_names_both():
    ok, bad = [1, 2], [7, 7]
    # 4 ranks (data 2 x spatial 2); tensors: a replicated weight, a sharded one
    table = _table([[ok, ok], [ok, [5, 5]], [ok, ok], [bad, [6, 6]]])
    found = replicas.disagreements(table, [("conv.bias", False), ("fc.weight", True)], spatial_size=2, data_size=2)
    by = {(d.name, d.replicas): d for d in found}
    assert by[("conv.bias", (0, 1, 2, 3))].odd == (3,) and by[("conv.bias", (0, 1, 2, 3))].majority
    # the sharded weight: its spatial blocks differ (0 vs 1) and are no replicas; its data
    # copies are (0, 2): alike, and (1, 3): a pair that differs, no majority
    assert ("fc.weight", (0, 2)) not in by
    pair = by[("fc.weight", (1, 3))]
    assert pair.odd == (1, 3) and not pair.majority
    msg = replicas.describe(9, found, 4)
    assert "step 9" in msg and "'conv.bias': rank 3 differs from the other 3 copies" in msg
    assert "the odd rank: rank 3" in msg and "no majority" in msg


def test_agreeing_replicas_and_sharded_blocks_pass():
    table = _table([[[1, 1], [2, 2]], [[1, 1], [3, 3]]])  # spatial 2: the sharded blocks differ
    assert replicas.disagreements(table, [("b", False), ("w", True)], spatial_size=2, data_size=1) == []


def test_tracked_tensors_are_parameters_and_optimiser_state_with_their_sharding():
    m = torch.nn.Linear(3, 2)
    m.weight.spatial_shard = True
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for p in m.parameters():  # as SGD's first step leaves it (without the step's import cost)
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    items = {t.name: t.sharded for t in replicas.tracked(m, m, opt)}
    assert items == {"weight": True, "weight (optimiser momentum_buffer)": True, "bias": False,
                     "bias (optimiser momentum_buffer)": False}


def test_the_fault_variable_is_parsed_strictly():
    spec = faults.parse("step=3, rank=1, tensor=features.0.bias, bit=22, at=grad")
    assert spec == faults.FlipSpec(3, 1, "features.0.bias", 22, 0, "grad")
    for bad, says in [("step=3,rank=1", "missing tensor"), ("step=x,rank=1,tensor=a", "step=x: want an integer"),
                      ("step=3,rank=1,tensor=a,colour=red", "'colour=red' is not one of"),
                      ("step=3,rank=1,tensor=a,at=loss", "at=loss: want weight, grad or state:<key>")]:
        with pytest.raises(InputError, match=says):
            faults.parse(bad)
    t = torch.ones(3)
    before, after = faults.flip_bit_(t, 31, 1)
    assert (before, after) == (1.0, -1.0) and t.tolist() == [1.0, -1.0, 1.0]
    with pytest.raises(InputError, match="3 elements of 32 bits"):
        faults.flip_bit_(t, 32, 0)


def test_kfac_low_rank_and_blocked_forms_are_tracked_tensor_by_tensor():
    """K-FAC's wide factors are held as low rank plus diagonal or blocked (parallel.kfac.lowrank):
    each of their tensors is a replica to check, like a dense eigendecomposition's Q and l."""
    from parallel.kfac.lowrank import Blocked, Structured

    u, lam = torch.randn(6, 2), torch.rand(2)
    dense = replicas._held("G", (torch.eye(3), torch.ones(3)))
    low = replicas._held("A", Structured(u, lam, torch.rand(6)))
    blocks = replicas._held("A", Blocked(u, lam, [torch.arange(3), torch.arange(3, 6)], [torch.eye(3)] * 2,
                                         [torch.ones(3)] * 2))
    assert [n for n, _ in dense] == ["QG", "lG"] and [n for n, _ in low] == ["UA", "lA", "dA"]
    assert [n for n, _ in blocks] == ["UA", "lA", "QA[0]", "QA[1]", "eA[0]", "eA[1]"]
    assert all(isinstance(t, torch.Tensor) for _, t in dense + low + blocks)


def test_kfac_blocks_held_by_their_ranks_are_compared_over_data_copies_only():
    """A hierarchical A whose blocks stay on their ranks (parallel.kfac.local): its factor A and
    the own blocks' q, e (one tensor each, however many blocks a rank holds) differ between
    the ranks of a spatial group; U and lam are replicas everywhere."""
    from types import SimpleNamespace

    from parallel.kfac.local import LocalBlocked

    m = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    u, lam = torch.randn(6, 2), torch.rand(2)
    held = LocalBlocked(u, lam, u[:4], [torch.arange(2), torch.arange(2, 3), torch.tensor([3])],
                        [torch.eye(2), torch.eye(1), torch.eye(1)], [torch.ones(2), torch.ones(1), torch.ones(1)], 1, None)
    opt.factors = {"weight": (torch.ones(5), torch.eye(2))}
    opt.eigen = {"weight": (held, (torch.eye(2), torch.ones(2)))}
    opt.layers = [SimpleNamespace(key="weight", own=object())]
    items = {t.name: (t.sharded, t.tensor.numel()) for t in replicas.tracked(m, m, opt) if "K-FAC" in t.name}
    assert items == {"weight (K-FAC factor A)": (True, 5), "weight (K-FAC factor G)": (False, 4),
                     "weight (K-FAC UA)": (False, 12), "weight (K-FAC lA)": (False, 2),
                     "weight (K-FAC QA (own blocks))": (True, 6), "weight (K-FAC eA (own blocks))": (True, 4),
                     "weight (K-FAC QG)": (False, 4), "weight (K-FAC lG)": (False, 2)}
