"""The training loop shared by CosmoFlow and the 3D U-Net.

>>> from parallel.train import train
>>> summary = train(cfg, family)        # collective: every rank calls it

Split by concern: ``config`` (typed sections), ``family`` (what a model supplies),
``data`` (readers), ``optim`` (optimiser and schedule), ``loop`` (the run),
``evaluate``, ``checkpoint``, ``report`` (metrics.jsonl, TensorBoard, summary),
``mlperf`` (the MLPerf log) and ``cli`` (the Hydra entry point).
"""

from parallel.train.config import JobConfig
from parallel.train.family import Family
from parallel.train.loop import train

__all__ = ["Family", "JobConfig", "train"]
