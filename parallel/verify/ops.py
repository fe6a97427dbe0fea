"""Which torch calls in a model's own forward act on D/H/W of a split tensor.

``describe_op`` looks at one call seen by ``parallel.verify``'s function mode and says, in
words for the error message, what it did to a split tensor (a 5-D block not marked
replicated), or returns None for calls that act per voxel or along batch and channels.
It only explains a difference the comparison found; it decides nothing by itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from parallel.layers.replicated import is_replicated
from parallel.partition import DIM_NAMES

RESIZE = {"interpolate", "upsample", "upsample_nearest", "upsample_bilinear", "grid_sample", "affine_grid"}
WINDOWED = {"conv3d", "conv_transpose3d", "max_pool3d", "avg_pool3d", "lp_pool3d", "adaptive_avg_pool3d",
            "adaptive_max_pool3d", "fractional_max_pool3d", "batch_norm", "instance_norm", "group_norm",
            "layer_norm", "local_response_norm", "pixel_shuffle", "pixel_unshuffle", "unfold", "fold"}
LOSSES = {"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "cross_entropy", "nll_loss", "kl_div",
          "binary_cross_entropy", "binary_cross_entropy_with_logits"}
JOINS = {"cat", "concat", "concatenate", "stack"}
ALONG = {"split", "chunk", "narrow", "roll", "flip", "unbind", "tensor_split", "cumsum", "cumprod", "softmax",
         "log_softmax", "index_select", "gather", "diff"}
REDUCE = {"sum", "mean", "amax", "amin", "max", "min", "std", "var", "norm", "logsumexp", "prod", "argmax",
          "argmin", "median", "all", "any", "nansum", "nanmean", "std_mean", "var_mean"}
RESHAPE = {"view", "reshape", "flatten", "view_as", "reshape_as", "permute", "transpose", "movedim", "unflatten",
           "squeeze", "swapaxes", "swapdims", "contiguous_view"}


def _split(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 5 and not is_replicated(t)


def _spatial(dim: Any, ndim: int = 5) -> list[int]:
    """The spatial dims (0, 1, 2 for D, H, W) among ``dim`` (an int or a sequence)."""
    if dim is None:
        return [0, 1, 2]
    dims = dim if isinstance(dim, (tuple, list)) else [dim]
    out = []
    for d in dims:
        if isinstance(d, int):
            d = d % ndim
            if d >= 2:
                out.append(d - 2)
    return out


def _names(axes: list[int]) -> str:
    return "/".join(DIM_NAMES[a] for a in sorted(set(axes)))


def _arg(args: Any, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def _index_touches_space(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in items):
        k = items.index(Ellipsis)
        after = items[k + 1:]
        return any(not (isinstance(i, slice) and i == slice(None)) for i in after[-3:])
    return any(not (isinstance(i, slice) and i == slice(None)) for i in items[2:5])


def describe_op(func: Any, args: Any, kwargs: dict, out: Any) -> str | None:
    """A description of what ``func(*args, **kwargs)`` did to D/H/W of a split tensor, or None."""
    name = getattr(func, "__name__", "")
    functional = getattr(F, name, None) is func
    x = args[0] if args else None
    if functional and name in RESIZE and _split(x):
        return f"F.{name} on a split tensor (it resizes this rank's block, not the volume)"
    if functional and name == "pad" and _split(x):
        pad = list(_arg(args, kwargs, 1, "pad", []))
        if any(pad[:6]):
            return f"F.pad of D/H/W by {tuple(pad[:6])} on a split tensor (it pads every block's edges)"
        return None
    if functional and name in WINDOWED and _split(x):
        weight = _arg(args, kwargs, 1, "weight")
        if name == "conv3d" and isinstance(weight, torch.Tensor) and tuple(weight.shape[2:]) == (1, 1, 1):
            return None  # a pointwise convolution is the same on a block
        return f"F.{name} on a split tensor (torch's function sees only this rank's block)"
    if functional and name in LOSSES and (_split(x) or _split(_arg(args, kwargs, 1, "target"))):
        return f"F.{name} over a split tensor (a mean over this rank's block, inside the model)"
    if name in JOINS:
        tensors = _arg(args, kwargs, 0, "tensors", [])
        if isinstance(tensors, (list, tuple)) and any(_split(t) for t in tensors):
            dim = _arg(args, kwargs, 1, "dim", 0)
            axes = _spatial(dim, 5 if name != "stack" else 6)
            if axes:
                return f"torch.{name} along dim {dim} ({_names(axes)}) of split tensors (it joins blocks, not volumes)"
        return None
    if not _split(x):
        return None
    if name in ALONG:
        dim = _arg(args, kwargs, 2 if name in ("split", "tensor_split") else 1, "dims" if name in ("roll", "flip")
                   else "dim", None if name in ("roll", "flip") else 0)
        axes = _spatial(dim) if dim is not None or name == "flip" else []
        return f"{name} along {_names(axes)} of a split tensor (it sees only this rank's block)" if axes else None
    if name in REDUCE:
        dim = _arg(args, kwargs, 1, "dim")
        if isinstance(dim, torch.Tensor):
            return None  # torch.max(a, b): element-wise
        axes = _spatial(dim)
        return f"{name} over {_names(axes)} of a split tensor (it reduces this rank's block only)" if axes else None
    if name == "__getitem__" and _index_touches_space(args[1] if len(args) > 1 else None):
        return "indexing or slicing along D/H/W of a split tensor (it selects from this rank's block)"
    if name in RESHAPE and isinstance(out, torch.Tensor) and (out.dim() != 5 or out.shape[2:] != x.shape[2:]):
        return (f"{name} of a split tensor {tuple(x.shape)} to {tuple(out.shape)}, which mixes or moves D/H/W "
                "(a block's voxels are not the volume's)")
    return None
