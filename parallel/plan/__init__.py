"""Choose the (data x spatial) split: an alpha-beta-gamma model of one training step.

In the spirit of LBANN's performance model for spatial parallelism: each layer's compute
is its flops on the rank's block over a measured throughput (gamma, per conv shape, from
``python scripts/benchmark.py calibrate``); each halo exchange, the Flatten+Linear
all-reduce and the gradient all-reduce cost ``alpha + bytes / beta`` per message (ring
all-reduce: ``2 (P-1) alpha + 2 (P-1)/P bytes / beta``); the halo is hidden behind the
interior when the overlap is on. Memory per rank is the runtime's fixed baseline,
weights, gradients and optimiser state, and the activations kept for the backward (only
block inputs and one block's internals under recomputation). Bytes read per rank are
the sample's stored bytes over the spatial size, times the local batch.

    python -m parallel.plan --size 512 --devices 64 --device-memory 80GB \\
        --set model.n_conv_blocks=7 --batch 64 --alpha 5e-6 --bandwidth 25e9 --compute-scale 100
    python -m parallel.plan --model NAME --size 64 --devices 2 --batch 2   # this machine

``--model`` names a family of ``configs/families.yaml`` (default: the first);
``--set model._target_=pkg.Net model.<arg>=...`` plans any network on that family's
samples, built as training builds it. Layers after a global pool are whole on every rank
(``trace`` follows that through the forward) and cost as serial layers. A
``parallel.spatial=auto`` training config asks ``choose`` for the world size at hand
(``parallel.train.checks.autosplit``).

One idea a module: ``machine`` (the measured figures), ``trace`` (the layers of a model),
``local`` (a rank's share of each layer), ``cost`` (the prediction), ``search`` (the
splits and the choice), ``models`` (families by name), ``cli`` (the command line, ``main``; this package's
docstring is its help, so the package does not import it).
"""

from parallel.model.trace import Layer, trace
from parallel.plan.cost import Options, overlap_policy, predict
from parallel.plan.local import LocalOp, first_layer, local_ops, op_key, valid
from parallel.plan.machine import Machine, default_calibration
from parallel.plan.models import build_model
from parallel.plan.search import choose, fit_hint, smallest_fit, splits, table

__all__ = ["Layer", "LocalOp", "Machine", "Options", "build_model", "choose", "default_calibration",
           "first_layer", "fit_hint", "local_ops", "op_key", "overlap_policy", "predict", "smallest_fit", "splits",
           "table", "trace", "valid"]
