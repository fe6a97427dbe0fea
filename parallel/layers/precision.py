"""The dtype a split layer forms and sums its partial results in.

A serial layer under autocast rounds its inputs to bfloat16 or float16, accumulates in
float32 and rounds its output once. A split layer whose ranks each form a partial result
(the split convolution's block and shell corrections, the sharded Flatten+Linear's partial
products) must do the same: form each partial from the rounded inputs in float32, sum the
partials in float32 (across ranks too), and round once at the end. Partials rounded to
low precision and summed there round once per rank, so the error grows with the number of
ranks (CosmoFlow's bf16 head at 2x2x1 ended 2.2x further from serial than the serial
bf16 run is from float32). A function of the dtype alone, never of the device: a GPU runs
the arithmetic the CPU tests prove.
"""

from __future__ import annotations

import torch

LOW = (torch.bfloat16, torch.float16)


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are computed and summed in, for inputs rounded to ``dtype``:
    float32 for bfloat16 and float16, the dtype itself otherwise."""
    return torch.float32 if dtype in LOW else dtype


def compute_dtypes(x: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(the dtype autocast rounds inputs to, else ``x``'s own; the dtype the sums run in)."""
    kind = x.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    return dtype, sum_dtype(dtype)
