"""The communication layer: every collective and point-to-point call of the framework.

Nothing outside this package calls torch.distributed's communication functions
(``tests/unit/test_comm_layer.py`` reads the sources and fails on any that does); the halo
exchange (``parallel.split.halo``) and the gradient sync (``parallel.model.gradsync``) are built on it.

- ``checks``: what a group accepts (device of its backend, dtype, a dense layout); a
  tensor it cannot take is refused with the caller's name.
- ``ops``: plain collectives (``all_reduce_``, ``all_reduce_async``, ``reduce_scatter_async``,
  ``all_gather_async``, ``broadcast_``,
  ``barrier``, ``all_gather``, ``all_gather_varlen``, ``all_gather_bytes``) and batched
  point-to-point messages (``exchange``), each waited for.
- ``autograd``: differentiable ones with exact adjoints (``all_reduce_sum``,
  ``spatial_sum``, ``replicated_grad``).

Devices: with NCCL, tensors live on the rank's GPU (``cuda:<local rank>``, set by
``parallel.init``); with gloo, on the CPU. Bookkeeping tensors (sizes, flags) are made
on the group's device, so no helper hands NCCL a CPU tensor.
"""

from parallel.comm.autograd import all_reduce_sum, replicated_grad, spatial_sum
from parallel.comm.checks import (
                                  SUPPORTED_DTYPES,
                                  CommError,
                                  backend_device,
                                  check_for_group,
                                  check_tensor,
                                  group_backend,
                                  group_device,
                                  group_size,
)
from parallel.comm.ops import (
                                  all_gather,
                                  all_gather_bytes,
                                  all_gather_varlen,
                                  all_reduce_,
                                  all_gather_async,
                                  all_reduce_async,
                                  barrier,
                                  broadcast_,
                                  exchange,
                                  reduce_scatter_async,
                                  sends_messages,
)

__all__ = [
    "SUPPORTED_DTYPES", "CommError", "all_gather", "all_gather_async", "all_gather_bytes", "all_gather_varlen",
    "all_reduce_", "all_reduce_async", "all_reduce_sum", "backend_device", "barrier", "broadcast_", "check_for_group",
    "check_tensor", "exchange", "group_backend", "group_device", "group_size", "reduce_scatter_async", "sends_messages",
    "replicated_grad", "spatial_sum",
]
