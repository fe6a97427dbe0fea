"""A steady training step waits only for its halo exchanges, the split layers' sums and
the gradient sync: counted through the job's real loop (``build_job(...).run()``, its
``TrainStep`` audited by tests/support/step_audit.py) at spatial 2x1x1 on CPU.

Before, every forward and micro-batch all-gathered the input's block sizes (and read them
with ``.tolist()``), and the U-Net augmentation all-gathered its data groups' row counts
every step. Now the loop declares its batches' volume (``fixed_volume``), the layers'
shape cache fills on the first step, and the augmentation takes its offsets from the
equal split. The one host read left in the step is the update's (``gradnorm.read_host``:
the global gradient norm and the loss in one transfer, from which every rank takes the
same non-finite, skip, fp16 and clipping decisions); with a sharded Flatten+Linear weight
its squared norm is summed over the spatial group first (one scalar all-reduce,
``gradnorm.global_grad_norm``). The U-Net augmentation reads its CPU-drawn random numbers
once (host data on every device).
"""

from __future__ import annotations

from collections import Counter

import pytest

import host_cases
from train_helpers import prepare

COMMON = ["train.global_batch_size=2", "train.max_steps=3", "train.eval_every=0", "train.eval_at_end=false",
          "run.progress=false", "run.tensorboard=false", "run.log_every=100"]
FAMILIES = {
    "cosmoflow": ["model.n_conv_blocks=2", "model.conv_filters=4", "model.dense_sizes=[8]"],
    "unet3d": ["data.crop=[16,16,16]", "model.depth=2", "model.base_filters=4"],
}
# What a step may wait for, by the code that asks: halo exchanges (point-to-point batches),
# the sums of split layers (norm statistics, Flatten+Linear partial products, and their
# adjoints in the backward) and the gradient sync.
ALLOWED = {
    "batch_isend_irecv": ("parallel.split.shell.", "parallel.split.halo."),
    "all_reduce": ("parallel.model.gradsync.", "parallel.layers.norm.", "parallel.layers.linear.", "parallel.comm.autograd.",
                   "parallel.train.gradnorm.global_grad_norm"),  # a sharded weight's squared norm, one scalar
}
READS_ALLOWED = {
    "parallel.train.gradnorm.read_host": 1,  # the global norm and the loss, one transfer per step
    "unet3d.family.augment": 2,              # .tolist() of the CPU generator's draws and keys
}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("audit")
    return {"cosmoflow": prepare("cosmoflow", root / "cosmo", 16, 4, 2),
            "unet3d": prepare("unet3d", root / "unet", 16, 4, 2)}


def _events(step: dict[str, int]) -> list[tuple[str, str, str, int]]:
    out = []
    for key, n in step.items():
        kind_name, _, where = key.partition(" <- ")
        kind, _, name = kind_name.partition(" ")
        out.append((kind, name, where, n))
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_steady_step_waits_only_for_halos_sums_and_the_gradient_sync(pools, data, family, tmp_path):
    per_rank = pools.run(2, host_cases.audited_steps, family, str(data[family]), str(tmp_path / "run"),
                         [*COMMON, *FAMILIES[family]], spatial=(2, 1, 1), timeout=600)
    for rank, steps in enumerate(per_rank):
        assert len(steps) == 3, steps
        for i, step in enumerate(steps[1:], start=2):
            events = _events(step)
            bad = [e for e in events if e[0] == "collective"
                   and not e[2].startswith(ALLOWED.get(e[1], ("(none)",)))]
            assert not bad, f"rank {rank} step {i}: collectives beyond halos, sums and the gradient sync: {bad}"
            reads = Counter()
            for kind, name, where, n in events:
                if kind == "read":
                    reads[where] += n
            extra = {w: n for w, n in reads.items() if n > READS_ALLOWED.get(w, 0)}
            assert not extra, f"rank {rank} step {i}: host reads {dict(reads)}"
            kinds = {e[1] for e in events if e[0] == "collective"}
            assert {"batch_isend_irecv", "all_reduce"} <= kinds, events  # the audit sees the step's messages
            assert any(e[2].startswith("parallel.model.gradsync.") for e in events), events
        assert steps[1] == steps[2], f"rank {rank}: steady steps differ: {steps[1]} vs {steps[2]}"
