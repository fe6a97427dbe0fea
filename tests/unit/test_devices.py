"""What parallel.init works out once at start-up, as pure functions
(``parallel/runtime/devices.py``): each rank's GPU (or a clear error), ranks sharing a GPU
named, NCCL's timeout margin above the watchdog, the CUDA maths. (A bounded barrier's
message: tests/ranks/test_barrier.py.)"""

import pytest
import torch

from parallel.runtime.devices import PlacementError, local_position, pick_device, plan_devices
from parallel.runtime.launch import NCCL_MARGIN_S, configure_cuda, process_group_timeout


@pytest.mark.parametrize("local_rank,local_size,n_gpus,expected", [
    (0, 1, 0, None),   # no GPU: the CPU
    (3, 4, 4, 3),      # one GPU per rank
    (1, 2, 8, 1),      # more GPUs than ranks
    (5, 8, 1, 0),      # each rank sees only its own GPU (CUDA_VISIBLE_DEVICES per rank)
])
def test_pick_device(local_rank, local_size, n_gpus, expected):
    assert pick_device(local_rank, local_size, n_gpus) == expected



def test_more_ranks_than_gpus_is_a_clear_error():
    with pytest.raises(PlacementError) as err:
        pick_device(5, 8, 4)
    assert str(err.value) == (
        "8 ranks on this node but only 4 GPUs visible to each: start at most 4 ranks per node "
        "(torchrun --nproc-per-node 4, mpirun -ppn 4, srun --ntasks-per-node 4), or bind each rank to its "
        "own GPU (CUDA_VISIBLE_DEVICES)")



def test_plan_devices_from_the_gathered_placement():
    hosts = ["a"] * 4 + ["b"] * 4
    gpus = [[f"{h}-gpu{i}" for i in range(4)] for h in hosts]
    assert plan_devices(hosts, gpus) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert local_position(hosts, 6) == (2, 4)
    bound = [[f"{h}-gpu{r % 4}"] for r, h in enumerate(hosts)]  # one GPU each, all different
    assert plan_devices(hosts, bound) == [0] * 8
    assert plan_devices(["a", "a"], [[], []]) == [None, None]



def test_ranks_sharing_a_gpu_are_named():
    hosts = ["a", "a", "b", "b"]
    same = [["a-gpu0"], ["a-gpu0"], ["b-gpu0"], ["b-gpu1"]]  # rank 0 and 1 see the same single GPU
    with pytest.raises(PlacementError, match=r"ranks 0 and 1 on node a would share GPU a-gpu0 \(2 ranks"):
        plan_devices(hosts, same)
    with pytest.raises(PlacementError, match=r"node b \(ranks 4-6\): 3 ranks on this node but only 2 GPUs"):
        plan_devices(["a"] * 4 + ["b"] * 3, [["g0", "g1", "g2", "g3"]] * 4 + [["g0", "g1"]] * 3)



def test_nccl_gets_a_margin_above_the_watchdog():
    assert process_group_timeout("gloo", 600) == 600  # gloo raises in the caller, which reports it
    assert process_group_timeout("nccl", 600) == 600 + NCCL_MARGIN_S
    assert process_group_timeout("nccl", 30) == 30 + NCCL_MARGIN_S
    assert process_group_timeout("nccl", 3600) == pytest.approx(3960)  # a tenth when that is more
    assert process_group_timeout("cpu:gloo,cuda:nccl", 100) > 100
    with pytest.raises(ValueError, match="parallel.timeout_s must be positive"):
        process_group_timeout("gloo", 0)



def test_tf32_off_by_default_and_on_by_request():
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark)
    try:
        configure_cuda()
        assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (False, False)
        assert torch.backends.cudnn.benchmark and torch.get_float32_matmul_precision() == "highest"
        configure_cuda(tf32=True, cudnn_benchmark=False)
        assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (True, True)
        assert not torch.backends.cudnn.benchmark
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark = saved
