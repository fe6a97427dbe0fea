"""The training loop shared by every model family.

>>> from parallel.train import train
>>> summary = train(cfg, family)        # collective: every rank calls it

Grouped by what the files do:

- ``cli``: the command line (Hydra's entry point, its settings, sweeps);
- ``checks``: what is decided before the first step (the config's values, the sample
  files, the network against the volumes and the split, ``parallel.spatial=auto``, the
  memory budget), each refusal one clear message;
- ``persist``: what a run keeps (checkpoints, the training state, RNG streams, the run
  directory);
- ``observe``: what a run tells (logs, metrics.jsonl, TensorBoard, the MLPerf log, step
  times, traces);
- the run: ``lifecycle`` (the process: start, watchdog, failure, exit codes), ``loop``
  (epochs of steps), ``step`` (one step and its non-finite guard), ``data`` (readers and
  batches), ``prefetch`` (batches copied to the GPU a step ahead), ``optim`` (optimiser
  and schedule), ``evaluate``, ``gradnorm`` (the global gradient norm every rank decides
  from), ``scaler`` (fp16 loss scaling), ``compiled`` (``train.compile``), ``stopsignal``
  (a signal such as Slurm's time-limit warning), ``elastic`` (a restart under torchrun).
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
