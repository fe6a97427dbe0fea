"""The split model checked against its serial self.

- ``check``: ``verify(serial, pmodel, probe)`` runs both once on a probe and names the
  first module whose output (or the first parameter whose gradient) differs, with the
  spatial operations its own ``forward`` applied to split tensors; ``probe_shape`` sizes
  a probe from the network's downsampling.
- ``ops``: which torch calls act on D/H/W of a split tensor (the words of that message).
- ``selfcheck``: the installation check, ``python -m parallel.selfcheck``, under any
  launcher.
"""

from parallel.verify.check import VerificationError, custom_forwards, probe_shape, verify

__all__ = ["VerificationError", "custom_forwards", "probe_shape", "verify"]
