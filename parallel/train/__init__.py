"""The training loop shared by every model family.

>>> from parallel.train import train
>>> summary = train(cfg, family)        # collective: every rank calls it

Split by concern, one idea a module:

- configuration: ``config`` (typed sections), ``choices`` (their fixed-choice
  values, as Enums), ``from_hydra`` (Hydra's composed config ->
  that typed tree, refusing unknown keys), ``hydra_conf`` (Hydra's own settings: output
  directories, help, sweep launchers), ``cli`` (the Hydra entry point);
- model families: ``family`` (what a model supplies, and the registry by name),
  ``usermodel`` (any network as ``model._target_=...``);
- before training: ``checks`` (a package: the job's checks in one pass, validate ->
  samples -> fit -> verify, and their errors), ``autosplit`` (``parallel.spatial=auto``),
  ``budget`` (``parallel.memory_limit``: the grid's predicted peak against it before the
  first step, and on CPUs the budget held while the job runs),
  ``rundir`` (the run-directory rule);
- the run: ``lifecycle`` (the process: start, watchdog, failure, exit codes), ``loop``
  (the trainer's run), ``step`` (one step and its non-finite guard), ``compiled``
  (``train.compile``: the split model under torch.compile, or the reason it is refused),
  ``gradnorm`` (the whole model's gradient norm, from which every rank takes the same decisions),
  ``scaler`` (fp16 loss scaling decided from that norm), ``data`` (readers and batches),
  ``prefetch`` (batches copied to the GPU a step ahead), ``optim`` (optimiser and
  schedule), ``evaluate``, ``stopsignal`` (a signal such as Slurm's time-limit warning:
  every rank checkpoints after the same step and stops), ``elastic`` (a restart under
  torchrun: re-grid, resume, one MLPerf log);
- what a run keeps and tells: ``state`` (what a checkpoint holds), ``checkpoint``
  (files), ``rng`` (the RNG streams' layout in a checkpoint), ``report``
  (metrics.jsonl, TensorBoard, summary), ``steptime`` (each step's compute, halo exchange,
  gradient all-reduce and data waiting), ``profile`` (``train.profile``: a torch.profiler
  trace per rank), ``mlperf`` (the MLPerf log), ``sweep`` (Hydra
  sweeps: a table of jobs);
- after training: ``predict`` (the set-up every family's predict command shares).
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
