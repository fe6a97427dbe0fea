"""What a process group accepts, checked before any tensor reaches it.

Each backend takes tensors on one device: NCCL only tensors on the rank's own GPU
(``cuda:<local>``, the device ``parallel.init`` set), gloo CPU tensors. Gloo also
accepts CUDA tensors for some collectives but not for point-to-point messages; the
framework keeps it simple and uses gloo for CPU tensors only (``parallel.init`` puts the
grid on the CPU when the backend is gloo). Other backends (mpi, ucc, a plugin) are not
checked for the device.

A tensor the group cannot take fails here, before the collective, with a message naming
the function that handed it over, e.g.
``parallel.layers.shapes.infer_global_dims: tensor on cpu, group on cuda:0 (nccl)``,
instead of an error deep inside the backend (or a hang).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

# What every backend the framework uses reduces and moves (NCCL has no int16; complex
# numbers and bool are left out on purpose: reductions of them mean different things).
SUPPORTED_DTYPES = frozenset({
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.uint8, torch.int8, torch.int32, torch.int64,
})


class CommError(ValueError):
    """A tensor that the group cannot take (device, dtype, layout); the message names the caller."""


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_size(group: Any) -> int:
    """Ranks in ``group`` (None: the default group); 1 when torch.distributed is not running."""
    if not initialized():
        return 1
    return dist.get_world_size(group)


def group_backend(group: Any) -> str:
    """The backend name of ``group`` (``"gloo"``, ``"nccl"``, ...); ``"none"`` without a process group."""
    if not initialized():
        return "none"
    return str(dist.get_backend(group))


def backend_device(backend: str) -> torch.device | None:
    """The device whose tensors ``backend`` takes: this rank's GPU for NCCL, the CPU for
    gloo, None (not checked) for other backends."""
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if backend in ("gloo", "none"):
        return torch.device("cpu")
    return None


def group_device(group: Any) -> torch.device:
    """Where bookkeeping tensors for ``group`` live (sizes, flags, byte buffers)."""
    return backend_device(group_backend(group)) or torch.device("cpu")


def caller_name() -> str:
    """``module.function`` of the first frame outside this package and torch (the code
    that handed the tensor over); computed only when a check fails."""
    frame = sys._getframe(1)
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if not (module.startswith("parallel.comm") or module == "torch" or module.startswith("torch.")):
            return f"{module}.{frame.f_code.co_qualname}"
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown caller>"


def _dense(t: torch.Tensor) -> bool:
    # torch's own rule: contiguous in the tensor's memory format (channels-last parameters pass)
    if t.is_contiguous():
        return True
    if t.dim() == 4:
        return t.is_contiguous(memory_format=torch.channels_last)
    return t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)


def check_tensor(t: Any, device: torch.device | None, backend: str, caller: str | None = None,
                 dtype: torch.dtype | None = None, what: str = "tensor") -> None:
    """Raise ``CommError`` naming ``caller`` unless the group (``backend`` on ``device``)
    can take ``t``: a dense tensor of a supported dtype (``dtype`` if given) on ``device``.

    Pure: the group's device and backend are passed in, so the rule is testable anywhere.
    """
    def fail(problem: str) -> CommError:
        return CommError(f"{caller or caller_name()}: {problem}")

    if not isinstance(t, torch.Tensor):
        raise fail(f"{what} is a {type(t).__name__}, not a torch.Tensor")
    if device is not None and (t.device.type != device.type
                               or (device.index is not None and t.device.index not in (None, device.index))):
        raise fail(f"{what} on {t.device}, group on {device} ({backend})")
    if dtype is not None and t.dtype != dtype:
        raise fail(f"{what} of dtype {t.dtype}, expected {dtype}")
    if t.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES))
        raise fail(f"{what} of dtype {t.dtype}, which collectives here do not take (one of {names})")
    if t.layout != torch.strided or not _dense(t):
        raise fail(f"{what} of shape {tuple(t.shape)} is not contiguous (strides {t.stride()}); "
                   "pass .contiguous()")


def check_for_group(t: Any, group: Any, caller: str | None = None, dtype: torch.dtype | None = None,
                    what: str = "tensor") -> None:
    """``check_tensor`` against ``group``'s backend and device."""
    backend = group_backend(group)
    check_tensor(t, backend_device(backend), backend, caller, dtype, what)
