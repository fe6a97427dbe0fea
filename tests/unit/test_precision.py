"""Precision and clipping rules, in one process: the split layers' partial sums (the shell
convolution's, the sharded Flatten+Linear's) take their precision from the dtype (never the
device); the global gradient norm and clipping of one
process are torch's; the loss scaler keeps torch's rules and its state_dict. (Split runs
at every precision against serial: tests/launch/test_contract_matrix.py.)"""

import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64],
                         ids=lambda d: str(d).split(".")[1])
def test_the_split_layers_sum_precision_depends_on_the_dtype_never_the_device(dtype):
    from types import SimpleNamespace

    from parallel.layers.precision import compute_dtypes

    want = (dtype, torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype)
    assert compute_dtypes(torch.zeros(1, dtype=dtype)) == want
    # a CUDA tensor cannot exist on this machine: a stand-in with the attributes the decision
    # reads; a branch on the device type (the old GPU path summed bf16 in bf16) fails here
    for device in ("cuda", "xpu", "mps"):
        assert compute_dtypes(SimpleNamespace(device=torch.device(device), dtype=dtype)) == want, device



def test_the_global_norm_of_one_process_is_torchs_and_clipping_scales_as_torch_does():
    from parallel.train.gradnorm import clip_coefficient, global_grad_norm, scale_grads_

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    twin = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    twin.load_state_dict(net.state_dict())
    x = torch.randn(4, 6)
    for m in (net, twin):
        m(x).square().sum().backward()
    norm = float(global_grad_norm(net.parameters()))
    want = float(torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.1))
    assert norm == pytest.approx(want, rel=1e-6)
    scale_grads_(list(net.parameters()), clip_coefficient(norm, 0.1))
    for a, b in zip(net.parameters(), twin.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)  # float32: one rounding apart
    assert clip_coefficient(norm, 0.0) == 1.0 and clip_coefficient(0.01, 0.1) == 1.0
    net[0].weight.grad[0, 0] = float("inf")
    assert not torch.isfinite(global_grad_norm(net.parameters()))



def test_the_loss_scaler_keeps_torchs_rules_and_state_dict():
    from parallel.train.precision import LossScaler

    s = LossScaler(growth_interval=2)
    s.update(True)
    assert s.get_scale() == 2.0**16
    s.update(True)
    assert s.get_scale() == 2.0**17  # doubled after 2 finite steps
    s.update(False)
    assert s.get_scale() == 2.0**16 and s.state_dict()["_growth_tracker"] == 0  # halved, count restarts
    theirs = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=3)
    mine = LossScaler()
    mine.load_state_dict(theirs.state_dict())
    assert mine.get_scale() == 8.0 and mine.growth_interval == 3
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(mine.state_dict())
    assert back.get_scale() == 8.0
