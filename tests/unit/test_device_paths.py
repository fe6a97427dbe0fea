"""Where GPU-only code puts its tensors, decided and checked on the CPU.

``scripts/benchmark.py step --device cuda`` all-reduced its trial times as a CPU tensor
over the NCCL group, and built its data-parallel grid on the CPU, so ``parallelize``
broadcast CPU parameters over NCCL: both stop at the first collective on GPUs. These
tests check the decisions (the device each tensor is put on) without a GPU;
``scripts/gpu_check.py``'s ``bench`` step runs the command on GPUs.
"""



import pytest
import torch

from parallel.bench import timing


class _Reduced(Exception):
    """Raised by the stand-in collective to stop after the first reduction."""



def test_trial_times_are_reduced_on_the_groups_device(monkeypatch):
    # NCCL's group device is the rank's GPU; "meta" stands for a device that is not the
    # CPU (no GPU here), and the collective itself is replaced by one that records where
    # the tensor it was handed lives.
    seen: list[torch.device] = []

    def all_reduce_(t: torch.Tensor, group: object, op: str = "sum", **kw: object) -> torch.Tensor:
        seen.append(t.device)
        raise _Reduced

    monkeypatch.setattr(timing.comm, "group_device", lambda group: torch.device("meta"))
    monkeypatch.setattr(timing.comm, "all_reduce_", all_reduce_)
    with pytest.raises(_Reduced):
        timing.interleaved({"a": lambda: None}, trials=1, warmup=0, group=object())
    assert seen == [torch.device("meta")]
    seen.clear()
    with pytest.raises(_Reduced):  # the caller's device wins
        timing.interleaved({"a": lambda: None}, trials=1, warmup=0, group=object(), device=torch.device("cpu"))
    assert seen == [torch.device("cpu")]



def test_training_batches_are_copied_ahead_on_gpus_only():
    # CUDA: the train loader leaves batches in pinned host memory and Batches copies each
    # one a step ahead on a side stream (parallel.train.prefetch, run by gpu_check's
    # trainings); the CPU path hands the loader's tensors through unchanged.
    from parallel.train.data import Batches
    from parallel.train.prefetch import AheadCopies, copies_ahead

    assert copies_ahead(torch.device("cuda", 0)) and not copies_ahead(torch.device("cpu"))
    assert not copies_ahead(None)
    fields = {"x": torch.ones(2, 1, 4, 4, 4)}
    plain = list(Batches([(dict(fields), "stats")]))
    assert plain[0][0].fields["x"] is fields["x"] and plain[0][1] == "stats"
    ahead = Batches([(dict(fields), "stats")], torch.device("cuda", 0))
    assert ahead.ahead == torch.device("cuda", 0) and isinstance(AheadCopies(ahead.loader, ahead.ahead), AheadCopies)
