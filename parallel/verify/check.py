"""Check a split model against its serial self on a small probe: no silent errors.

``parallelize`` converts the layers it knows; what a model's own ``forward`` does
functionally (``F.interpolate``, ``F.pad``, ``torch.cat`` or slicing along D/H/W, a
``view`` that mixes spatial dims, a reduction over the volume) it cannot see, and on a
split tensor such an operation sees only this rank's block. ``verify`` runs the serial
model and the split model once on the same probe volume, with forward hooks on every
module of both, and compares every module's output (each rank its block against the same
block of the serial output; replicated outputs whole) and, optionally, every parameter
gradient. Where they differ it raises ``VerificationError`` naming the first module, in
forward order, whose output differs, and the spatial operations its own ``forward``
applied to split tensors during the probe (recorded by a ``TorchFunctionMode``).

The probe is small (``probe_shape``: the network's total downsampling factor times the
split per dim, at least twice that factor), so the serial forward on every rank costs
little; dropout is switched off during the check, and the model's buffers (BatchNorm
running statistics) and gradients are put back afterwards (random draws: ``parallel.model.random_draws``).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from parallel import comm
from parallel.grid import Grid
from parallel.layers.base import SpatialMixin
from parallel.layers.norm import SpatialBatchNorm3d
from parallel.layers.replicated import is_replicated
from parallel.model.parallel_module import ParallelModule
from parallel.model.random_draws import DrawRecorder, SameStream, check_split_draws
from parallel.partition import SplitError
from parallel.split.nested import tensors as _leaves
from parallel.split.scatter import scatter
from parallel.verify.ops import describe_op
from parallel.verify.probe import probe_shape

log = logging.getLogger("parallel")

DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
# Differences of summation order grow through deep networks; a split error is O(1).
RTOL = {torch.float64: 1e-6, torch.float32: 1e-3}
ADVICE = ("a functional spatial operation in a model's own forward sees only this rank's block: use the "
          "module forms (nn.Upsample, nn.ConstantPad3d, nn.AdaptiveAvgPool3d, ...), keep torch.cat and "
          "slicing to the channel dim, or gather the tensor first (docs/parallel.md, 'Models you bring')")


class VerificationError(RuntimeError):
    """The split model's numbers differ from the serial model's on the probe."""


def custom_forwards(model: nn.Module) -> list[str]:
    """Names of the modules whose ``forward`` is not a ``torch.nn`` layer's or container's:
    the code ``parallelize`` cannot see (empty: verification has nothing to find)."""
    return [name or type(m).__name__ for name, m in model.named_modules()
            if not type(m).__module__.startswith("torch.nn") and not isinstance(m, SpatialMixin)]


class _Recorder(TorchFunctionMode):
    """Records spatial operations on split tensors by the module whose forward runs them."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[tuple[str, str, bool]] = []  # (module name, class name, is a spatial layer)
        self.events: list[tuple[Any, ...]] = []       # ("op", module, class, text) and ("done", (module, call))

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.stack and not self.stack[-1][2]:
            note = describe_op(func, args, kwargs or {}, out)
            if note:
                self.events.append(("op", self.stack[-1][0], self.stack[-1][1], note))
        return out

    def causes(self, key: tuple[str, int]) -> list[str]:
        """The spatial operations on split tensors run before module call ``key`` finished,
        the most recent first, each with the module whose own forward ran it."""
        seen = []
        for event in self.events:
            if event[0] == "done" and event[1] == key:
                break
            if event[0] == "op":
                seen.append(f"{event[3]}, in the forward of '{event[1]}' ({event[2]})")
        return list(dict.fromkeys(reversed(seen)))


def _flattens_volume(mod: nn.Module, inputs: Any) -> bool:
    """Whether ``mod`` is a ``Flatten(1, -1)`` called on a 5-D tensor."""
    return (isinstance(mod, nn.Flatten) and mod.start_dim == 1 and mod.end_dim == -1 and len(inputs) == 1
            and isinstance(inputs[0], torch.Tensor) and inputs[0].dim() == 5)


def _hook_all(model: nn.Module, calls: list, recorder: _Recorder | None = None) -> list:
    """Forward hooks that append (name, call number, cloned outputs, replicated flags)."""
    counts: dict[str, int] = {}
    hooks = []
    for name, m in model.named_modules():
        label = name or "<model>"

        def done(mod: nn.Module, inputs: Any, out: Any, label: str = label) -> None:
            k = counts.get(label, 0)
            counts[label] = k + 1
            leaves = _leaves(out)
            if _flattens_volume(mod, inputs):
                # A split Flatten hands its 5-D block to the Linear after it (partial products):
                # compare the volume it flattens, which is its output in either model's layout.
                leaves = [inputs[0]]
            calls.append(((label, k), type(mod).__name__, [t.detach().clone() for t in leaves],
                          [is_replicated(t) for t in leaves]))
            if recorder is not None:
                recorder.events.append(("done", (label, k)))
                if recorder.stack:
                    recorder.stack.pop()

        hooks.append(m.register_forward_hook(done))
        if recorder is not None:
            entry = (label, type(m).__name__, isinstance(m, SpatialMixin))
            hooks.append(m.register_forward_pre_hook(lambda _m, _i, entry=entry: recorder.stack.append(entry)))
    return hooks


def _difference(got: torch.Tensor, ref: torch.Tensor, replicated: bool, grid: Grid,
                floor: float = 1e-12) -> tuple[float, str]:
    """Max difference of this rank's part against the serial tensor, relative to the
    serial tensor's largest value (or ``floor``, for tensors that are zero in exact maths)."""
    expected = ref
    if got.dim() >= 5 and ref.dim() == got.dim() and not replicated:  # volumes: D, H, W are the last dims
        try:
            block = ref[(...,) + grid.block_slices(ref.shape[-3:])]
        except SplitError:
            block = None
        if block is not None and got.shape == block.shape:
            expected = block
    if got.shape != expected.shape:
        return math.inf, f"shape {tuple(got.shape)} where the serial block is {tuple(expected.shape)}"
    if not expected.is_floating_point():
        return (0.0 if torch.equal(got, expected) else math.inf), "values"
    diff = (got.double() - expected.double()).abs()
    diff[torch.isnan(got) & torch.isnan(expected)] = 0.0
    scale = max(float(expected.double().abs().nan_to_num(0.0).max()) if expected.numel() else 0.0, floor)
    err = float(diff.max()) / scale if diff.numel() else 0.0
    return (math.inf if math.isnan(err) else err), "values"


def _max_over_ranks(values: list[float], grid: Grid) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=grid.device)
    comm.all_reduce_(t, grid.world_group, "max", caller="parallel.verify")  # every rank, one verdict
    return t.tolist()


def _loss(outs: list[torch.Tensor], weights: list[torch.Tensor]) -> torch.Tensor:
    return sum((o * w).sum() for o, w in zip(outs, weights) if o.is_floating_point())  # type: ignore[return-value]


def verify(serial: nn.Module, pmodel: ParallelModule, probe: Sequence[int] | torch.Tensor | None = None, *,
           grads: bool = True, rtol: float | None = None, seed: int = 0) -> dict[str, Any]:
    """Run ``serial`` and ``pmodel`` on the same probe and compare; raise where they differ.

    ``serial`` is the model as it was before ``parallelize`` (a copy; its weights are
    replaced by the split model's). ``probe`` is a shape (N, C, D, H, W) or a global tensor,
    the same on every rank (default: ``probe_shape``). ``grads`` also compares every
    parameter gradient after one backward of a fixed random projection of the outputs.
    Collective over the grid's world. Returns the largest relative differences.
    """
    grid = pmodel.grid
    model = pmodel.module
    serial.to(grid.device)
    serial.load_state_dict(pmodel.state_dict())
    dtype = next((p.dtype for p in serial.parameters() if p.is_floating_point()), torch.float32)
    if probe is None:
        probe = probe_shape(serial, grid)
    gen = torch.Generator().manual_seed(seed)
    x = probe if isinstance(probe, torch.Tensor) else torch.randn(tuple(probe), generator=gen, dtype=dtype)
    x = x.to(grid.device)
    rtol = RTOL.get(dtype, 5e-2) if rtol is None else rtol
    saved_buffers = [b.detach().clone() for b in model.buffers()]
    saved_grads = [p.grad for p in model.parameters()]
    modes = [(m, m.training) for m in (*model.modules(), *serial.modules())]
    for m in (*model.modules(), *serial.modules()):
        if isinstance(m, DROPOUTS):
            m.eval()
    try:
        with SameStream(grid.device) as stream:
            return _compare(serial, pmodel, x, grid, grads, rtol, seed, stream)
    finally:
        for m, training in modes:
            m.train(training)
        with torch.no_grad():
            for b, old in zip(model.buffers(), saved_buffers):
                b.copy_(old)
        for p, g in zip(model.parameters(), saved_grads):
            p.grad = g
        serial.zero_grad(set_to_none=True)
        if pmodel.sync is not None:
            pmodel.sync._reset()  # a probe backward that left parameters without gradient


def _compare(serial: nn.Module, pmodel: ParallelModule, x: torch.Tensor, grid: Grid, grads: bool, rtol: float,
             seed: int, stream: SameStream) -> dict[str, Any]:
    synced = any(isinstance(m, SpatialBatchNorm3d) and m.sync_data for m in pmodel.module.modules())
    rows = [(0, x.shape[0])] if synced else [grid_rows(grid, x.shape[0], d) for d in range(grid.data_size)]
    mine = 0 if synced else grid.data_rank
    r0, r1 = grid.batch_range(x.shape[0])
    serial_calls: list = []
    ref_grads: dict[str, torch.Tensor] = {}
    ref_outs: list[torch.Tensor] = []
    weights: list[torch.Tensor] = []
    serial_draws: list = []
    for unit, (a, b) in enumerate(rows):
        hooks = _hook_all(serial, serial_calls) if unit == mine else []
        stream.restart()
        try:
            with torch.set_grad_enabled(grads), DrawRecorder(serial) as drawn:
                out = _leaves(serial(x[a:b]))
            serial_draws = drawn.draws if unit == mine else serial_draws  # this data group's
        except Exception as err:  # noqa: BLE001 - the probe is wrong, not the split
            raise ValueError(f"the serial {type(serial).__name__} does not accept the probe of shape "
                             f"{tuple(x.shape)} ({type(err).__name__}: {err}); pass a probe it accepts") from err
        finally:
            for h in hooks:
                h.remove()
        g = torch.Generator().manual_seed(seed + 7919 * (unit + 1))
        unit_weights = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o) for o in out]
        if unit == mine:
            ref_outs, weights = out, unit_weights
        if grads:
            serial.zero_grad(set_to_none=True)
            _loss(out, unit_weights).backward()
            for name, p in serial.named_parameters():
                if p.grad is not None:
                    ref_grads[name] = ref_grads.get(name, 0) + p.grad / len(rows)  # type: ignore[operator]
    if synced:  # one serial forward over the global batch: compare this data group's rows
        serial_calls = [(k, t, [v[r0:r1] if v.dim() and v.shape[0] == x.shape[0] else v for v in vs], f)
                        for k, t, vs, f in serial_calls]
        ref_outs = [o[r0:r1] for o in ref_outs]
        weights = [w[r0:r1] for w in weights]
    split_calls: list = []
    recorder = _Recorder()
    hooks = _hook_all(pmodel.module, split_calls, recorder)
    stream.restart()
    try:
        with torch.set_grad_enabled(grads), recorder, DrawRecorder(pmodel.module) as drawn:
            outs = _leaves(pmodel(scatter(x, grid)))
    except Exception as err:
        where = recorder.stack[-1][0] if recorder.stack else "<model>"
        raise VerificationError(f"the split model failed on the probe {tuple(x.shape)} at spatial {grid.spatial} "
                                f"in module '{where}': {type(err).__name__}: {err}") from err
    finally:
        for h in hooks:
            h.remove()
    check_split_draws(serial_draws, drawn.draws, grid, f"on probe {tuple(x.shape)}", VerificationError)
    report = _check_outputs(serial_calls, split_calls, recorder, grid, rtol, tuple(x.shape))
    if grads:
        local = []
        for o, w, s in zip(outs, weights, ref_outs):
            part = w
            if o.dim() >= 5 and w.dim() == o.dim() and o.shape != w.shape:
                part = w[(...,) + grid.block_slices(w.shape[-3:])]
            local.append(part)
        _loss(outs, local).backward()
        report.update(_check_grads(pmodel.module, ref_grads, grid, rtol))
    log.info("verified %s against its serial self on probe %s at %s: largest difference %.2e",
             type(pmodel.module).__name__, tuple(x.shape), grid.describe(), max(report.values(), default=0.0))
    return report


def grid_rows(grid: Grid, n: int, data_rank: int) -> tuple[int, int]:
    """The rows of a global batch of ``n`` that data group ``data_rank`` takes."""
    from parallel.partition import block_bounds

    return block_bounds(n, grid.data_size)[data_rank]


def _check_outputs(serial_calls: list, split_calls: list, recorder: _Recorder, grid: Grid, rtol: float,
                   shape: tuple[int, ...]) -> dict[str, float]:
    split = {key: (vals, flags) for key, _, vals, flags in split_calls}
    errs, notes = [], []
    for key, _, vals, _ in serial_calls:
        got = split.get(key)
        if got is None or len(got[0]) != len(vals):
            errs.append(math.inf)
            notes.append("not called the same way in the split model")
            continue
        worst, note = 0.0, "values"
        for g, f, v in zip(got[0], got[1], vals):
            err, what = _difference(g, v, f, grid)
            if err > worst:
                worst, note = err, what
        errs.append(worst)
        notes.append(note)
    errs = _max_over_ranks(errs, grid)
    for i, err in enumerate(errs):
        if err > rtol:
            (name, call), cls, _, _ = serial_calls[i]
            causes = recorder.causes((name, call))
            raise VerificationError(_explain(name, call, cls, err, notes[i], causes, grid, shape))
    return {"outputs": max(errs, default=0.0)}


def _explain(name: str, call: int, cls: str, err: float, note: str, causes: list[str], grid: Grid,
             shape: tuple[int, ...]) -> str:
    what = f"a {note}" if note.startswith("shape") else f"a largest relative difference of {err:.3g}"
    text = (f"verification failed at spatial {grid.spatial} on probe {shape}: the output of module '{name}' "
            f"({cls}){f' at its call {call + 1}' if call else ''} differs from the serial model's ({what}); it is "
            "the first module, in forward order, whose output differs.")
    if causes:
        text += " Likely cause: " + "; then ".join(causes[:3]) + "."
    else:
        text += (f" Likely cause: a spatial operation in the forward of '{name}' (or of the module that calls it) "
                 "that no converted layer covers.")
    return f"{text} Why: {ADVICE}."


def _check_grads(model: nn.Module, ref: dict[str, torch.Tensor], grid: Grid, rtol: float) -> dict[str, float]:
    names, errs = [], []
    # A gradient that is zero in exact maths (a conv bias before a norm) is rounding noise:
    # measure it against the largest gradient of the model.
    floor = 1e-3 * max((float(g.abs().max()) for g in ref.values() if g.numel()), default=1.0)
    for name, p in model.named_parameters():
        expected = ref.get(name)
        if expected is None and p.grad is None:
            continue
        names.append(name)
        if expected is None or p.grad is None:
            errs.append(math.inf)
            continue
        owner = model.get_submodule(name.rpartition(".")[0])
        if getattr(owner, "shard", None) is not None and name.endswith("weight"):  # a sharded Linear: its columns
            expected = owner.cut(expected)  # type: ignore[operator]
        errs.append(_difference(p.grad, expected, True, grid, floor)[0])
    errs = _max_over_ranks(errs, grid)
    for name, err in zip(names, errs):
        if err > rtol:
            raise VerificationError(
                f"verification failed at spatial {grid.spatial}: every module output matched, but the gradient of "
                f"'{name}' differs from the serial model's (largest relative difference {err:.3g}). Likely cause: a "
                "replicated tensor used as if split (or the reverse) in a model's own forward, e.g. a 5-D output "
                f"that is the same on every rank. Why: {ADVICE}.")
    return {"gradients": max(errs, default=0.0)}
