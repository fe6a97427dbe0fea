"""The whole CosmoFlow training step against LBANN DistConv's, on one harness
(``scripts/benchmark.py peers --cases step-cosmoflow-D-n64``).

On a 2-rank world, interleaved trial by trial (``parallel.bench.timing.interleaved``):

- ``serial``: the plain model on the whole batch, rank 0 alone (one thread), the other
  rank idle, as in ``benchmark.py step``;
- ``project``: the same model under ``parallelize`` on a 2-way split (the Flatten+Linear
  weight sharded by block, as the training loop runs it), its block of the batch;
- ``distconv``: the same model run the way DistConv's PyTorch package runs a network: the
  convolution blocks on a ``DCTensor`` (its halo exchange; the activations and pooling
  act on the shard), ``to_ddp()`` to hand each rank one sample of the batch for the dense
  head, and ``DistConvDDP`` for the gradients;
- ``floor``: both ranks running the plain model on a block-sized volume at once, no
  communication (what the split step would take if halos and reductions cost nothing).

Each step is forward, a mean-square loss over the global batch, backward and an SGD step
with momentum. Before the timing, DistConv's loss and first convolution's weight gradient
are checked against the serial model's (dropout off): a peer that computes something else
is skipped with the reason, as in ``parallel.bench.peers``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import parallel
from parallel.bench.shared import agree, failure
from parallel.bench.step import Stepper, make_model, step_grids
from parallel.bench.timing import interleaved, median, ratio
from parallel.comm import all_reduce_
from parallel.grid import Grid

SPLITS = {"D": (2, 1, 1), "W": (1, 1, 2)}


@dataclass(frozen=True)
class StepCase:
    """The training step of ``model`` at ``size``^3, global batch ``batch``, split 2 ways."""

    split: str
    size: int
    model: str = "cosmoflow"
    batch: int = 2

    @property
    def id(self) -> str:
        return f"step-{self.model}-{self.split}-n{self.size}"

    @property
    def spatial(self) -> tuple[int, int, int]:
        return SPLITS[self.split]  # type: ignore[return-value]


def parse_step(text: str) -> StepCase:
    """``step-cosmoflow-D-n64`` -> StepCase; a clear error naming what is wrong."""
    parts = text.split("-")
    try:
        _, model, split, n = parts
        if model != "cosmoflow" or split not in SPLITS or not n.startswith("n"):
            raise ValueError
        return StepCase(split, int(n[1:]), model)
    except ValueError:
        raise ValueError(f"peers step case {text!r}: expected step-cosmoflow-SPLIT-nN with SPLIT in "
                         f"{', '.join(SPLITS)} (e.g. step-cosmoflow-D-n64); DistConv has no U-Net "
                         "layers (transposed convolutions, norms) to compare") from None


class _OnDCTensor(nn.Module):
    """CosmoFlow as DistConv runs a network: convolution blocks on the shard, the dense
    head on the batch dim after ``to_ddp()``."""

    def __init__(self, model: nn.Module, strategy: Any) -> None:
        super().__init__()
        self.model = model
        self.strategy = strategy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from distconv import DCTensor

        m = self.model
        if m.input_shift != 0.0 or m.input_scale != 1.0:  # element-wise: the same on the shard
            x = (x - m.input_shift) * m.input_scale
        y = m.features(DCTensor.from_shard(x, self.strategy))
        return m.head(y.to_ddp())


class DistConvStepper:
    """One DistConv training step on this rank's block of the batch."""

    def __init__(self, grid: Grid, model: nn.Module, x_block: torch.Tensor, batch: int) -> None:
        from distconv import DistConvDDP, ParallelStrategy

        axis = next(a for a in range(3) if grid.spatial[a] > 1)
        self.strategy = ParallelStrategy(num_shards=(grid.spatial[axis],), shard_dim=(axis + 2,),
                                         device_type="cpu")
        self.net = DistConvDDP(_OnDCTensor(model, self.strategy), parallel_strategy=self.strategy)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=1e-4, momentum=0.9)
        self.x = x_block
        self.batch = batch

    def loss(self) -> torch.Tensor:
        # Each rank holds batch / ranks samples after to_ddp(); DistConvDDP sums the ranks'
        # gradients, so the global mean (Stepper's loss) is the local sum over all the
        # batch's outputs.
        out = self.net(self.x).float()
        return out.square().sum() / (self.batch * out[0].numel())

    def step(self) -> None:
        self.loss().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _distconv_check(grid: Grid, case: StepCase, model: nn.Module, x: torch.Tensor, x_block: torch.Tensor) -> str:
    """Why DistConv's step is not the serial step here ('' where it is): loss and the first
    convolution's weight gradient, dropout off."""
    serial = copy.deepcopy(model).eval()
    loss = serial(x).float().square().mean()
    loss.backward()
    ref = serial.features[0].weight.grad
    peer = DistConvStepper(grid, copy.deepcopy(model).eval(), x_block, case.batch)
    mine = peer.loss()
    mine.backward()
    total = mine.detach().clone()
    all_reduce_(total, grid.spatial_group, caller="peer_step._distconv_check")  # the ranks' parts of the global mean
    got = peer.net.module.model.features[0].weight.grad
    scale = max(1.0, float(ref.abs().max()))
    total, loss = total.detach(), loss.detach()
    if abs(float(total) - float(loss)) > 1e-4 * max(1.0, abs(float(loss))):
        return f"loss {float(total):.6g} differs from the serial {float(loss):.6g}"
    if float((got - ref).abs().max()) > 1e-4 * scale:
        return f"features.0.weight gradient differs from the serial by {float((got - ref).abs().max()):.3g}"
    return ""


def time_step(grid: Grid, case: StepCase, trials: int, peers: tuple[str, ...],
              paths: tuple[str, ...] = (), channels_last: bool = False) -> dict[str, Any]:
    """Seconds per step of serial, project (the training loop's default conv path, and each
    of ``paths`` forced as ``parallel.conv_path`` would), DistConv (where present and equal)
    and the floor; with ``channels_last`` each again with NDHWC activations (``*_cl``: the
    input laid out so; the project as ``parallel.channels_last`` runs it). Each contestant is
    over the serial step of its own layout (``over_serial``) and, with ``channels_last``, over
    the faster of the two serial steps (``over_best_serial``); the project's over the fastest
    DistConv (``over_best_peer``)."""
    serial_grid, _ = step_grids(grid)
    size = (case.size,) * 3
    model, in_shape = make_model(case.model, size, [])
    block = [n // s for n, s in zip(size, grid.spatial)]
    steppers: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    x_block = None
    if "distconv" in peers:
        gen = torch.Generator().manual_seed(1)
        x = torch.randn((case.batch, *in_shape), generator=gen)  # the batch Stepper draws
        x_block = parallel.scatter(x, grid).clone()
        try:
            reason = _distconv_check(grid, case, model, x, x_block)
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
            reason = failure(e)
        if not agree(not reason, grid.world_group):
            skipped["distconv"] = reason or "failed on another rank"
            x_block = None
    if "shardtensor" in peers:
        skipped["shardtensor"] = "not in the step harness (its backward fails on this torch: docs/benchmarks/peers_conv_distconv_cpu-2core_2026-12-06.md)"
    for cl in (False, True) if channels_last else (False,):
        tag = "_cl" if cl else ""
        steppers["serial" + tag] = Stepper(serial_grid, case.model, size, [], case.batch, active=grid.rank == 0,
                                           channels_last=cl)
        steppers["project" + tag] = Stepper(grid, case.model, size, [], case.batch, channels_last=cl)
        for path in paths:
            steppers[f"project_{path}{tag}"] = Stepper(grid, case.model, size, [], case.batch, conv_path=path,
                                                       channels_last=cl)
        if x_block is not None:
            xb = x_block.contiguous(memory_format=torch.channels_last_3d) if cl else x_block
            peer = DistConvStepper(grid, copy.deepcopy(model), xb, case.batch)
            why = ""
            if cl:  # one trial step: its halo exchange may refuse a channels-last shard
                try:
                    peer.step()
                except Exception as e:  # noqa: BLE001 - reported, not fatal
                    why = failure(e)
            if agree(not why, grid.world_group):
                steppers["distconv" + tag] = peer
            else:
                skipped["distconv" + tag] = why or "failed on another rank"
        try:
            steppers["floor" + tag] = Stepper(serial_grid, case.model, block, [], case.batch, channels_last=cl)
        except ValueError as e:  # the model does not fit a block-sized volume (small test cases)
            skipped["floor" + tag] = str(e)
    times = interleaved({k: s.step for k, s in steppers.items()}, trials, warmup=1, group=grid.world_group)
    serial_of = {k: "serial_cl" if k.endswith("_cl") else "serial" for k in steppers}
    out: dict[str, Any] = {"seconds": {k: median(v) for k, v in times.items()}, "skipped": skipped,
                           "over_serial": {k: ratio(times[k], times[serial_of[k]])
                                           for k in steppers if not k.startswith("serial")}}
    if channels_last:  # the serial step at its faster layout: the honest baseline for every contestant
        fastest = min(("serial", "serial_cl"), key=lambda k: median(times[k]))
        out["best_serial"] = fastest
        out["over_best_serial"] = {k: ratio(times[k], times[fastest]) for k in steppers if not k.startswith("serial")}
    peer_keys = [k for k in steppers if k.startswith("distconv")]
    if peer_keys:
        best = min(peer_keys, key=lambda k: median(times[k]))
        out["best_peer"] = best
        out["over_best_peer"] = {k: ratio(times[k], times[best]) for k in steppers if k.startswith("project")}
    return out


def time_steps(grid: Grid, cases: list[StepCase], trials: int, peers: tuple[str, ...],
               paths: tuple[str, ...] = (), channels_last: bool = False) -> list[dict[str, Any]]:
    """``time_step`` for each case of one split, in one set of ranks."""
    return [time_step(grid, c, trials, peers, paths, channels_last) for c in cases]
