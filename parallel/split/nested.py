"""The tensors inside a nested structure of arguments or results: the one walk the tracer
(``parallel.model.trace``), the verifier (``parallel.verify``) and the halo's background
exchange (``parallel.split.halo``) each need."""

from __future__ import annotations

from typing import Any

import torch


def tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in ``obj``: a tensor, or (nested) tuples, lists and dict values of them,
    in order; anything else holds none."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors(o)]
    return []
