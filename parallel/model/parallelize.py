"""Turn a serial model into its hybrid-parallel form for a grid.

``parallelize(model, grid)`` converts the model's layers in place into their spatial
twins (same parameters, same ``state_dict`` keys) and wraps it in a ``ParallelModule``
that synchronises gradients during the backward. Models know nothing of parallelism:
a model that runs serially runs split, with the same numbers.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Mapping, Sequence, Union

import torch
from torch import nn

from parallel import comm
from parallel.grid import Grid
from parallel.layers.adaptive import SpatialAdaptiveAvgPool3d, SpatialAdaptiveMaxPool3d
from parallel.layers.base import SpatialMixin, convert
from parallel.layers.conv.layer import SpatialConv3d, SpatialConvTranspose3d
from parallel.layers.conv.paths import check_path
from parallel.layers.dropout import SpatialDropout, SpatialDropout3d
from parallel.layers.linear import SpatialFlatten, SpatialLinear
from parallel.layers.norm import SpatialBatchNorm3d, SpatialGroupNorm, SpatialInstanceNorm3d
from parallel.layers.pad import SpatialCircularPad3d, SpatialConstantPad3d, SpatialZeroPad3d
from parallel.layers.pool import SpatialAvgPool3d, SpatialMaxPool3d
from parallel.layers.shapes import ShapeTracker
from parallel.layers.upsample import SpatialUpsample
from parallel.model.flatshard import flatten_inputs, shard_linears, structure
from parallel.model.parallel_module import ParallelModule
from parallel.model.recompute import checkpoint_blocks
from parallel.split import layout

log = logging.getLogger("parallel")

# What ``overlap_halo`` accepts: off (None, False), on (True), or a policy asked per split
# convolution and geometry, ``policy(layer, shell, input_shape) -> bool``.
OverlapPolicy = Union[None, bool, Callable[[Any, Any, Sequence[int]], bool]]
ShardPolicy = Callable[[str, nn.Module, tuple[int, ...]], bool]

SPATIAL_TWINS: dict[type, type] = {
    nn.Conv3d: SpatialConv3d,
    nn.ConvTranspose3d: SpatialConvTranspose3d,
    nn.MaxPool3d: SpatialMaxPool3d,
    nn.AvgPool3d: SpatialAvgPool3d,
    nn.AdaptiveAvgPool3d: SpatialAdaptiveAvgPool3d,
    nn.AdaptiveMaxPool3d: SpatialAdaptiveMaxPool3d,
    nn.Upsample: SpatialUpsample,
    nn.ConstantPad3d: SpatialConstantPad3d,
    nn.ZeroPad3d: SpatialZeroPad3d,
    nn.CircularPad3d: SpatialCircularPad3d,
    nn.BatchNorm3d: SpatialBatchNorm3d,
    nn.SyncBatchNorm: SpatialBatchNorm3d,
    nn.InstanceNorm3d: SpatialInstanceNorm3d,
    nn.GroupNorm: SpatialGroupNorm,
    nn.Dropout: SpatialDropout,
    nn.Dropout3d: SpatialDropout3d,
}

_NO_FORM = "has no spatial-parallel form; run it on a gathered tensor or change the model"

# Layers whose maths spans space in a way no spatial twin covers: refused by name, not guessed.
UNSUPPORTED: dict[type, str] = {
    **{t: _NO_FORM for t in (
        nn.Conv1d, nn.Conv2d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.MaxPool1d, nn.MaxPool2d,
        nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool1d,
        nn.AdaptiveMaxPool2d, nn.LPPool3d, nn.LocalResponseNorm, nn.FractionalMaxPool3d, nn.MaxUnpool3d,
        nn.Unflatten, nn.LazyConv3d, nn.LazyConvTranspose3d, nn.Fold, nn.Unfold)},
    nn.LayerNorm: "normalises over the trailing dims (W, or H and W, of a 5-D tensor) per voxel row; "
                  "no spatial-parallel form (use GroupNorm or InstanceNorm3d, or put it after a global pool)",
    nn.PixelShuffle: "moves channels into D/H/W in blocks of the scale factor; no spatial-parallel form",
    nn.PixelUnshuffle: "moves D/H/W blocks into channels; no spatial-parallel form",
    nn.ReflectionPad3d: "mirrors voxels at the volume's edges, which the halo exchange does not provide "
                        "(use ConstantPad3d, ZeroPad3d or CircularPad3d)",
    nn.ReplicationPad3d: "repeats the volume's edge voxels, which the halo exchange does not provide "
                         "(use ConstantPad3d, ZeroPad3d or CircularPad3d)",
}

# Known networks whose own forward does what a split cannot (checked by qualified class
# name, so the package need not be installed): refused with the reason.
KNOWN_UNSPLITTABLE: dict[str, str] = {
    "monai.networks.nets.segresnet.SegResNetVAE":
        "its forward flattens the encoder's split output with view(-1, in_features) (mixing D/H/W) and "
        "computes the VAE loss with F.mse_loss over the volume inside the model; use SegResNet or SegResNetDS",
}


def refusal(name: str, layer: nn.Module) -> str | None:
    """Why ``layer`` (named ``name``) cannot be split, or None when it can."""
    cls = type(layer)
    qual = f"{cls.__module__}.{cls.__qualname__}"
    if qual in KNOWN_UNSPLITTABLE:
        return f"'{name}' ({cls.__name__}) cannot be split in space: {KNOWN_UNSPLITTABLE[qual]}"
    for kind, reason in UNSUPPORTED.items():
        if isinstance(layer, kind):
            return f"layer '{name}' ({cls.__name__}) {reason}"
    if isinstance(layer, (nn.Conv3d, nn.ConvTranspose3d)) and layer.padding_mode not in ("zeros", "circular"):
        return (f"layer '{name}' ({cls.__name__}): padding_mode '{layer.padding_mode}' is not supported under "
                "spatial parallelism (use 'zeros' or 'circular'): it needs mirrored or edge voxels of the volume")
    if isinstance(layer, nn.ConvTranspose3d) and layer.padding_mode != "zeros":
        return f"layer '{name}' (ConvTranspose3d): only 'zeros' padding exists in torch"
    if isinstance(layer, nn.Upsample) and cls not in SPATIAL_TWINS and not isinstance(layer, SpatialMixin):
        return f"layer '{name}' ({cls.__name__}) is a 2-D upsampling layer; use nn.Upsample"
    return None


def _check_supported(name: str, layer: nn.Module) -> None:
    reason = refusal(name, layer)
    if reason is not None:
        raise NotImplementedError(reason)


def _convert_children(parent: nn.Module, prefix: str, grid: Grid, shapes: ShapeTracker,
                      sync_batchnorm: bool) -> None:
    children = list(parent.named_children())
    for i, (name, child) in enumerate(children):
        full = f"{prefix}{name}"
        if isinstance(child, nn.Flatten):
            nxt = children[i + 1][1] if i + 1 < len(children) else None
            flat = convert(child, SpatialFlatten, grid, shapes, full)
            setattr(parent, name, flat)
            if not isinstance(parent, nn.Sequential) or not isinstance(nxt, nn.Linear) or child.start_dim != 1 \
                    or child.end_dim != -1:
                flat.feeds_linear = False  # fine after a global pool; refused at run time on a split block
                continue
            lin_name = children[i + 1][0]
            lin = convert(nxt, SpatialLinear, grid, shapes, f"{prefix}{lin_name}")
            lin.flatten_name = full
            setattr(parent, lin_name, lin)
            children[i + 1] = (lin_name, lin)
            continue
        if isinstance(child, SpatialLinear):
            continue
        twin = SPATIAL_TWINS.get(type(child))
        if twin is not None:
            _check_supported(full, child)
            new = convert(child, twin, grid, shapes, full)
            if isinstance(new, SpatialBatchNorm3d):
                new.sync_data = sync_batchnorm
            setattr(parent, name, new)
            continue
        _check_supported(full, child)
        _convert_children(child, f"{full}.", grid, shapes, sync_batchnorm)


def _seed_dropout(module: nn.Module, grid: Grid, seed: int | None) -> None:
    """Same dropout stream on every rank of a spatial group, another per data group."""
    layers = [m for m in module.modules() if isinstance(m, (SpatialDropout, SpatialDropout3d))]
    if not layers:
        return
    raw = torch.initial_seed() if seed is None else seed
    base = torch.tensor([raw % 2**62], dtype=torch.int64, device=grid.device)  # initial_seed may exceed int64
    if grid.spatial_size > 1:
        root = grid.rank_at((0, 0, 0))
        comm.broadcast_(base, root, grid.spatial_group)
    base_seed = int(base) % 2**62
    for i, layer in enumerate(layers):
        group_seed = (base_seed + 1_000_003 * grid.data_rank + 7919 * i) % 2**63
        rank_seed = (group_seed + 104_729 * (grid.spatial_rank + 1)) % 2**63
        layer.seed(group_seed, rank_seed, grid.device)


def parallelize(model: nn.Module, grid: Grid, *, sync_batchnorm: bool = False,
                bucket_mb: float = 25.0, seed: int | None = None, overlap_halo: OverlapPolicy = None,
                recompute: bool = False, input_shape: Sequence[int] | None = None,
                shard_linear: bool | ShardPolicy = True, conv_path: str = "shell",
                conv_window_bytes: int | None = None, channels_last: bool = False) -> ParallelModule:
    """The hybrid-parallel form of ``model`` for ``grid`` (layers converted in place).

    ``sync_batchnorm`` makes BatchNorm statistics span the data groups too (the global
    batch); otherwise each data group normalises its own rows, as under DDP. ``seed``
    seeds the dropout streams (default: torch's initial seed on the spatial root).
    ``overlap_halo`` runs convolutions' halo exchanges beside their block's convolution:
    True, False (the layer's default, None, is off), or a policy each split convolution asks
    at its first forward, ``policy(layer, shell, input_shape) -> bool`` (``"auto"`` in the
    public ``parallel.parallelize`` and the training loop is the planner's,
    ``parallel.plan.overlap_policy``: where the calibration says the messages take longer
    than handing them to the halo thread; ``docs/performance.md``);
    ``shard_linear``: Flatten+Linear layers keep only their block's columns of the weight
    (``parallel.layers.linear``): the weight, gradient and optimiser state per rank fall by
    the split, and ``state_dict`` gathers the whole weight (a collective over the spatial
    group). With ``input_shape`` (one sample's (C, D, H, W)) the weight is cut here; without
    it, at the model's first forward on a split block, before any layer runs
    (``parallel.model.flatshard``; the parameter object stays the same, so an optimiser built
    before that forward holds the shard); or a policy ``policy(name, layer, (C, D, H, W)) ->
    bool`` per Flatten+Linear (K-FAC's, ``parallel.kfac.shard_policy``: only the layers whose
    factor it holds local to the blocks);
    ``conv_path`` is how split convolutions run: ``"shell"`` (the block convolved in place,
    the halos' contributions added), ``"window"`` (block and halos copied into one tensor,
    one convolution) or ``"auto"``: per layer, the faster of the two, timed at its first
    forward; ``conv_window_bytes`` caps the window copy a layer may keep (a memory budget;
    larger windows take the shell) (``parallel.layers.conv.paths``, ``docs/performance.md``).
    The shell is the default: it holds no copy of the block, which the memory budget of a
    training job (``parallel.memory_limit``) is predicted for; the window and the timing
    trials of ``"auto"`` take more;
    ``recompute`` keeps only each block's input and recomputes the block in the backward
    (``parallel.model.recompute``): less memory, about one more forward of time.
    ``channels_last`` lays the activations out NDHWC (``torch.channels_last_3d``): the
    inputs on entry and every convolution's output (``parallel.split.layout``); the halo
    messages, the parameters and ``state_dict`` are the same as without it.
    The check against the serial model (``verify=``) is the public ``parallel.parallelize``'s,
    which calls this and then ``parallel.verify``.
    """
    check_path(conv_path, "parallelize")
    if not (overlap_halo is None or isinstance(overlap_halo, bool) or callable(overlap_halo)):
        raise ValueError(f"overlap_halo must be True, False or a policy (parallel.plan.overlap_policy), got "
                         f"{overlap_halo!r}; 'auto' is the public parallel.parallelize's")
    model.to(grid.device)
    shapes = ShapeTracker(grid)
    flat: Mapping[str, tuple[int, ...]] = {}
    probe = None  # without input_shape: the serial structure on the meta device, traced at the first forward
    if shard_linear and grid.spatial_size > 1 and any(isinstance(m, nn.Flatten) for m in model.modules()):
        if input_shape is not None:
            flat = flatten_inputs(model, input_shape)
        else:
            probe = structure(model)
    if grid.spatial_size > 1 or sync_batchnorm:
        if grid.spatial_size > 1:
            _check_supported(type(model).__name__, model)
        root = SPATIAL_TWINS.get(type(model))
        if root is not None:  # a single layer parallelised on its own
            _check_supported(type(model).__name__, model)
            model = convert(model, root, grid, shapes, type(model).__name__)
            if isinstance(model, SpatialBatchNorm3d):
                model.sync_data = sync_batchnorm
        _convert_children(model, "", grid, shapes, sync_batchnorm)
        _seed_dropout(model, grid, seed)
        for m in model.modules():
            if isinstance(m, SpatialConv3d):
                m.path = conv_path
                m.window_limit_bytes = conv_window_bytes
                if overlap_halo is not None:
                    m.overlap = overlap_halo
    if recompute:
        n_blocks = checkpoint_blocks(model)
        log.debug("recomputing %d blocks in the backward", n_blocks)
    if grid.world_size > 1:
        # Start every replica from the same weights, as DDP does.
        for tensor in list(model.parameters()) + list(model.buffers()):
            comm.broadcast_(tensor.data, 0, grid.world_group)
    if callable(shard_linear):
        for name, m in model.named_modules():
            if isinstance(m, SpatialLinear):
                m.shard_policy = functools.partial(shard_linear, name)
    if flat:  # after the broadcast: every rank cuts its columns of the same weight
        shard_linears(model, grid, flat)
    pending = False
    if shard_linear and grid.spatial_size > 1:  # the rest shard at the first forward on a split block
        for m in model.modules():
            if isinstance(m, SpatialLinear) and m.shard is None and m.flatten_name:
                m.shard_pending = pending = True
    log.debug("parallelised %s over %s", type(model).__name__, grid.describe())
    pmodel = ParallelModule(model, grid, shapes, bucket_mb, shape_probe=probe if pending else None)
    if channels_last:
        _lay_out_channels_last(pmodel)
    return pmodel


def _channels_last_output(module: nn.Module, inputs: tuple, output: Any) -> Any:
    return layout.channels_last(output) if isinstance(output, torch.Tensor) else output


def _lay_out_channels_last(pmodel: ParallelModule) -> None:
    """NDHWC from end to end: the inputs on entry, and the output of every layer with a
    spatial form (oneDNN returns NCDHW for a convolution of a few input channels, e.g.
    CosmoFlow's 4, and the split upsampling assembles NCDHW); element-wise layers keep the
    layout they are given. A no-op where the output is NDHWC already."""
    pmodel.channels_last = True
    for m in pmodel.module.modules():
        if isinstance(m, SpatialMixin) or type(m) in SPATIAL_TWINS:
            m.register_forward_hook(_channels_last_output)
