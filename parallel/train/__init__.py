"""The training loop shared by every model family.

>>> from parallel.train import train
>>> summary = train(cfg, family)        # collective: every rank calls it

Grouped by what the files do (each folder a layer: docs/parallel.md's module map):

- ``checks``: what is decided before the first step (the config's values, the sample
  files, the network against the volumes and the split, ``parallel.spatial=auto``, the
  memory budget, the split model against its serial self), each refusal one message;
- ``persist``: what a run keeps (the checkpoint writer, the training state, RNG
  streams, the run directory);
- ``observe``: the run's events and their observers (logs, metrics.jsonl, TensorBoard,
  the MLPerf log, checkpoints as they fall due, step times, traces) and the summary;
- the run: ``lifecycle`` (``train()``: the process, start to exit code), ``job`` (the
  job built on its grid, top to bottom), ``loop`` (epochs of steps; the run's end),
  ``step`` (one step and its non-finite guard), ``data`` (readers and batches),
  ``prefetch`` (batches copied to the GPU a step ahead), ``optim`` (optimiser and
  schedule), ``evaluate`` (the evaluation and its schedule), ``gradnorm`` (the global
  gradient norm every rank decides from), ``precision`` (autocast, fp64, the fp16 loss
  scaler), ``stopsignal`` (a signal such as Slurm's time-limit warning), ``elastic`` (a
  restart under torchrun), ``replicas`` (every copy of a parameter bitwise alike, checked),
  ``replay`` (a suspicious step run again: a transient fault or the data), ``faults`` (a
  bit flipped on purpose, for the tests of both);
- ``cli``: the command line (Hydra's entry point, its settings, sweeps).
"""

from typing import Any

from parallel.job.config import JobConfig
from parallel.job.family import Family

__all__ = ["Family", "JobConfig", "train"]


def __getattr__(name: str) -> Any:
    # ``train`` pulls in the whole loop (MLPerf logging, TensorBoard): loaded on first use,
    # so that importing a family or the planner stays light.
    if name == "train":
        from parallel.train.lifecycle import train

        return train
    raise AttributeError(f"module 'parallel.train' has no attribute {name!r}")
