"""MLPerf logging (``:::MLLOG {json}`` lines) to ``run.dir/mlperf.log``.

Only rank 0 writes; every other rank gets a logger that does nothing, so it is called
unconditionally. The job (``parallel.train.job``) logs what it sets up (``log_submission``,
the staging, the sample counts); ``MLPerfEvents`` logs the run as it observes it
(``parallel.train.observe.events``). The order of events follows the HPC ruleset 3.0.0
(staging before ``run_start``)::

    cache_clear, init_start, submission_*, number_of_*, hyperparameters,
    staging_start, staging_stop, init_stop, run_start,
    (epoch_start, [eval_start, eval_error, eval_stop], epoch_stop)*, run_stop

Check a log with ``python -m mlperf_logging.compliance_checker --usage hpc --ruleset 3.0.0
run.dir/mlperf.log`` (CosmoFlow) or ``--usage training --ruleset 4.0.0`` (the U-Net,
``mlperf.usage=training``: Training's key names, ``gradient_accumulation_steps``, and the
unet3d rules' ``oversampling``, ``training_input_shape``, ``validation_input_shape``,
``validation_overlap``). The closed division wants ``optim.name=sgd``; other optimisers
belong to ``mlperf.division=open`` (a K-FAC run is logged as open whatever the setting).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mlperf_logging import mllog
from mlperf_logging.mllog import constants as C
from mlperf_logging.mllog.mllog import MLLogger

from parallel.grid import Grid
from parallel.job.config import JobConfig, MLPerfConfig, RunConfig
from parallel.train.observe.events import Observer, RunEnd


class MLPerfLog:
    """A thin wrapper over ``mllog.MLLogger`` that writes to one file on rank 0."""

    def __init__(self, path: str | Path | None, enabled: bool = True) -> None:
        self.enabled = enabled and path is not None
        self._mllogger: MLLogger | None = None
        if self.enabled:
            logger = logging.getLogger(f"parallel.mlperf.{Path(path).resolve()}")
            logger.propagate = False
            logger.setLevel(logging.INFO)
            for h in list(logger.handlers):
                logger.removeHandler(h)
                h.close()
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            handler = logging.FileHandler(str(path), mode="a")
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handler)
            self._logger = logger
            self._mllogger = MLLogger(logger=logger, default_stack_offset=2)

    def event(self, key: str, value: Any = None, **metadata: Any) -> None:
        if self._mllogger is not None:
            self._mllogger.event(key=key, value=value, metadata=metadata or None)

    def start(self, key: str, value: Any = None, **metadata: Any) -> None:
        if self._mllogger is not None:
            self._mllogger.start(key=key, value=value, metadata=metadata or None)

    def end(self, key: str, value: Any = None, **metadata: Any) -> None:
        if self._mllogger is not None:
            self._mllogger.end(key=key, value=value, metadata=metadata or None)

    def run_start(self, step: int) -> None:
        """``run_start`` (``step``: where the run stands; a restarted session's log says it)."""
        self.start(mllog.constants.RUN_START)

    def close(self) -> None:
        if self._mllogger is not None:
            for h in list(self._logger.handlers):
                self._logger.removeHandler(h)
                h.close()
            self._mllogger = None


def open_log(run: RunConfig, mlperf: MLPerfConfig, grid: Grid) -> MLPerfLog:
    """The run's MLPerf log: real on rank 0 when enabled, silent elsewhere.

    A log already in ``run.dir`` belongs to an interrupted run being resumed: it is kept as
    ``mlperf.log.<k>`` and the resumed run writes a fresh, complete ``mlperf.log`` (a
    resumed run is not a valid timed MLPerf run, but each log stays well-formed).
    """
    path = Path(run.dir) / "mlperf.log"
    if grid.rank == 0 and mlperf.enabled and path.is_file() and path.stat().st_size > 0:
        k = 1
        while path.with_name(f"mlperf.log.{k}").exists():
            k += 1
        path.rename(path.with_name(f"mlperf.log.{k}"))
        logging.getLogger("parallel.train").warning(
            "resuming: the interrupted run's MLPerf log is kept as %s; a resumed run is not a "
            "valid timed MLPerf result", path.with_name(f"mlperf.log.{k}"))
    return MLPerfLog(path if grid.rank == 0 else None, mlperf.enabled)


def log_submission(ml: Any, cfg: JobConfig, grid: Grid, benchmark: str, n_nodes: int) -> None:
    """``init_start`` and the submission and hyperparameter keys (once per run): the whole
    job's hyperparameters, so ``cfg`` is the job."""
    c = mllog.constants
    ml.event(c.CACHE_CLEAR, True)
    ml.start(c.INIT_START)
    ml.event(c.SUBMISSION_BENCHMARK, cfg.mlperf.benchmark or benchmark)
    ml.event(c.SUBMISSION_ORG, cfg.mlperf.org)
    ml.event(c.SUBMISSION_DIVISION, division(cfg.mlperf, str(cfg.optim.name)))
    ml.event(c.SUBMISSION_STATUS, cfg.mlperf.status)
    ml.event(c.SUBMISSION_PLATFORM, cfg.mlperf.platform)
    ml.event(c.SEED, cfg.train.seed)
    ml.event("number_of_ranks", grid.world_size)
    ml.event("number_of_nodes", n_nodes)
    accel = 0 if grid.device.type == "cpu" else max(1, grid.world_size // max(n_nodes, 1))
    ml.event("accelerators_per_node", accel)
    ml.event("spatial_split", list(grid.spatial))
    ml.event(c.GLOBAL_BATCH_SIZE, cfg.train.global_batch_size)
    training = usage(cfg.mlperf) == "training"
    ml.event("gradient_accumulation_steps" if training else "gradient_accumulation_frequency", cfg.train.accum_steps)
    ml.event(c.OPT_NAME, cfg.optim.name)
    ml.event(c.OPT_BASE_LR, cfg.optim.peak_lr(cfg.train.global_batch_size))
    ml.event(c.OPT_LR_WARMUP_EPOCHS, cfg.sched.warmup_epochs)
    start = cfg.optim.lr if cfg.sched.warmup_start_lr is None else cfg.sched.warmup_start_lr
    peak = cfg.optim.peak_lr(cfg.train.global_batch_size)
    ml.event("opt_learning_rate_warmup_factor", peak / start if start > 0 else 0.0)
    ml.event("opt_learning_rate_decay_boundary_epochs", list(cfg.sched.decay_epochs))
    ml.event("opt_learning_rate_decay_factor", list(cfg.sched.decay_factors))
    ml.event(c.OPT_WEIGHT_DECAY, cfg.optim.weight_decay)
    if cfg.optim.name in ("sgd", "kfac"):
        ml.event("opt_momentum", cfg.optim.momentum)
    if cfg.optim.name == "kfac":  # open division: its settings, under keys of their own
        k = cfg.optim.kfac
        for key in ("damping", "factor_interval", "inverse_interval", "factor_decay", "kl_clip"):
            ml.event(f"opt_kfac_{key}", getattr(k, key))
    dropout = getattr(cfg.model, "dropout", None)
    if dropout is not None:
        ml.event("dropout", dropout)
    if training:
        log_segmentation(ml, cfg)


def division(mlperf: MLPerfConfig, optimizer: str) -> str:
    """``mlperf.division``, except that a K-FAC run is logged as ``open`` (with a warning):
    the closed division fixes the reference's optimiser (SGD), so it never claims closed."""
    value = str(mlperf.division)
    if value == "closed" and str(optimizer) == "kfac":
        logging.getLogger("parallel.train").warning(
            "mlperf.division=closed with optim.name=kfac: the closed division wants the reference's SGD, so the "
            "MLPerf log says open (set mlperf.division=open to silence this)")
        return "open"
    return value


def usage(mlperf: MLPerfConfig) -> str:
    """The ruleset family of the run's log: ``mlperf.usage`` (a family's job sets it),
    else ``hpc``."""
    return str(mlperf.usage) if mlperf.usage is not None else "hpc"


def log_segmentation(ml: MLPerfLog, cfg: JobConfig) -> None:
    """The keys MLPerf Training's unet3d rules add: the crop and its oversampling, the
    evaluation's window and overlap (``whole`` where the run uses whole volumes)."""
    crop = cfg.data.crop
    ml.event("oversampling", cfg.data.oversampling if crop else 0.0)
    ml.event("training_input_shape", [int(v) for v in crop] if crop else "whole")
    sliding = str(cfg.eval.mode) == "sliding"
    window = cfg.eval.window or crop
    ml.event("validation_input_shape", [int(v) for v in window] if sliding and window else "whole")
    ml.event("validation_overlap", cfg.eval.overlap if sliding else 0.0)
    ml.event("evaluation_start_epoch", cfg.eval.start_epoch)
    ml.event("evaluation_frequency", cfg.train.eval_every)


class MLPerfEvents(Observer):
    """The run as the MLPerf log records it: ``run_start``, each epoch and evaluation (the
    metric under the family's key), ``run_stop`` with ``success`` or ``aborted``."""

    def __init__(self, ml: Any, eval_key: str, metric_key: str) -> None:
        self.ml, self.eval_key, self.metric_key = ml, eval_key, metric_key

    def run_start(self, progress: Any) -> None:
        self.ml.end(C.INIT_STOP)
        self.ml.run_start(progress.step)

    def epoch_start(self, epoch: int) -> None:
        self.ml.start(C.EPOCH_START, epoch_num=epoch + 1)

    def epoch_end(self, epoch: int) -> None:
        self.ml.end(C.EPOCH_STOP, epoch_num=epoch + 1)

    def eval_start(self, epoch_num: int) -> None:
        self.ml.start(C.EVAL_START, epoch_num=epoch_num)

    def evaluated(self, progress: Any, epoch_num: int, values: dict[str, Any]) -> None:
        self.ml.event(self.eval_key, values[self.metric_key], epoch_num=epoch_num)
        self.ml.end(C.EVAL_STOP, epoch_num=epoch_num)

    def run_end(self, end: RunEnd) -> None:
        self.ml.end(C.RUN_STOP, status="success" if end.reached else "aborted")  # MLPerf knows only these two
        self.ml.close()
