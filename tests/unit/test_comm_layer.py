"""The communication layer: no torch.distributed communication outside ``parallel/comm/``
(read from the sources), and the layer's checks refuse what a group cannot take, naming
the caller, in one process. (On real ranks: tests/ranks/test_comm_refusals.py.)"""

import fnmatch
from pathlib import Path

import pytest
import torch

from comm_audit import audit, find_calls, is_communication
from parallel import comm

ROOT = Path(__file__).resolve().parents[2]



SCANNED = ("parallel", "cosmoflow", "unet3d", "scripts")



LAYER = ("parallel/comm/*",)  # the communication layer; parallel/split/halo.py and gradsync.py build on it



def _matches(path: str, patterns: tuple[str, ...] | set[str]) -> bool:
    return any(fnmatch.fnmatch(path, p) for p in patterns)



def test_no_communication_outside_the_layer():
    calls = audit(ROOT, SCANNED)
    assert any(_matches(c.path, LAYER) for c in calls), "the audit found nothing in the layer itself: broken?"
    outside = [c for c in calls if not _matches(c.path, LAYER)]
    assert not outside, ("torch.distributed communication outside parallel/comm/ (use parallel.comm):\n"
                         + "\n".join(map(str, outside)))



@pytest.mark.parametrize("source,expected", [
    ("import torch.distributed as dist\ndist.all_reduce(t)", ["all_reduce"]),
    ("import torch\ntorch.distributed.barrier()", ["barrier"]),
    ("from torch import distributed as d\nd.broadcast(t, 0)", ["broadcast"]),
    ("from torch.distributed import all_gather_into_tensor", ["from torch.distributed import all_gather_into_tensor"]),
    ("import torch.distributed as dist\nops = [dist.P2POp(dist.isend, t, 1)]", ["P2POp", "isend"]),
    ("import torch.distributed as dist\ndist.distributed_c10d.send(t, 1)", ["send"]),
    ("import torch.distributed as dist\ndist.broadcast_object_list(x)", ["broadcast_object_list"]),
    ("import torch.distributed.nn.functional as F", ["import torch.distributed.nn.functional"]),
    ("import torch.distributed as dist\ndist.init_process_group('gloo'); dist.new_group([0]); dist.get_rank()", []),
    ("import torch.distributed as dist\nx = dist.ReduceOp.SUM; dist.TCPStore", []),
    ("import numpy as np\nnp.broadcast_to(a, (2,)); torch.gather(a, 0, i)", []),
], ids=["alias", "full-path", "from-torch", "import-name", "p2p-refs", "submodule", "object", "functional",
        "lifecycle-ok", "types-ok", "other-libraries-ok"])
def test_audit_finds_what_it_should(source, expected):
    assert [c.name for c in find_calls(source)] == expected



def test_names():
    for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "irecv", "monitored_barrier",
                 "all_to_all_single", "gather_object", "_all_gather_base"):
        assert is_communication(name), name
    for name in ("init_process_group", "new_group", "get_rank", "ReduceOp", "reduce_op", "is_initialized"):
        assert not is_communication(name), name



def _refusal(t, device=torch.device("cpu"), backend="gloo", dtype=None) -> str:
    with pytest.raises(comm.CommError) as err:
        comm.check_tensor(t, device, backend, dtype=dtype)
    return str(err.value)



def test_wrong_device_is_refused_naming_the_caller():
    msg = _refusal(torch.empty(3, device="meta"))
    assert msg == "test_comm_layer._refusal: tensor on meta, group on cpu (gloo)"



def test_cpu_tensor_for_a_gpu_group_is_refused():
    # NCCL's device, as parallel.init sets it; only the rule is exercised (no GPU is touched)
    msg = _refusal(torch.zeros(3), torch.device("cuda", 0), "nccl")
    assert msg.endswith("tensor on cpu, group on cuda:0 (nccl)")



def test_wrong_dtype_and_layout_are_refused():
    assert "dtype torch.complex64" in _refusal(torch.zeros(2, dtype=torch.complex64))
    assert "dtype torch.int16" in _refusal(torch.zeros(2, dtype=torch.int16))
    assert "dtype torch.float32, expected torch.int64" in _refusal(torch.zeros(2), dtype=torch.int64)
    msg = _refusal(torch.zeros(4, 3).t())
    assert "not contiguous" in msg and "(3, 4)" in msg
    assert "not a torch.Tensor" in _refusal([1, 2])



def test_dense_layouts_pass():
    comm.check_tensor(torch.zeros(2, 3), torch.device("cpu"), "gloo")
    comm.check_tensor(torch.zeros(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d), torch.device("cpu"),
                      "gloo")  # torch's collectives take channels-last parameters too
    comm.check_tensor(torch.zeros(2, dtype=torch.bfloat16), None, "mpi")  # device unchecked for other backends



def test_without_a_process_group_helpers_are_the_identity():
    t = torch.arange(3.0)
    assert comm.all_reduce_(t, None) is t and comm.broadcast_(t, 0, None) is t
    assert comm.all_gather_varlen(t, None)[0] is t and comm.all_gather_bytes(b"ab", None) == [b"ab"]
    comm.barrier(None, timeout_s=1.0)
    comm.all_reduce_async(t, None).wait()
