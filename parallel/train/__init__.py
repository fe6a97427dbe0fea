"""The training loop shared by every model family.

>>> from parallel.train import train
>>> summary = train(cfg, family)        # collective: every rank calls it

Split by concern: ``config`` (typed sections), ``family`` (what a model supplies, and
the registry by name), ``preflight`` (checks and the sample facts, before training),
``data`` (readers and batches), ``optim`` (optimiser and schedule), ``lifecycle`` (the
process: start, watchdog, failure, exit codes), ``loop`` (the trainer's run), ``step``
(one step and its non-finite guard), ``state`` (what a checkpoint holds),
``evaluate``, ``checkpoint`` (files), ``report`` (metrics.jsonl, TensorBoard, summary),
``mlperf`` (the MLPerf log), ``autosplit`` (``parallel.spatial=auto``), ``usermodel``
(any network as ``model._target_=...``), ``verification`` (``parallel.verify`` before the
first step) and ``cli`` (the Hydra entry point).
"""

from typing import Any

from parallel.train.config import JobConfig
from parallel.train.family import Family

__all__ = ["Family", "JobConfig", "train"]


def __getattr__(name: str) -> Any:
    # ``train`` pulls in the whole loop (MLPerf logging, TensorBoard): loaded on first use,
    # so that importing a family or the planner stays light.
    if name == "train":
        from parallel.train.lifecycle import train

        return train
    raise AttributeError(f"module 'parallel.train' has no attribute {name!r}")
