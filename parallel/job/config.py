"""Typed configuration of a training job, one dataclass per section.

Registered as Hydra structured configs by each model family's entry point
(``python -m <family>.train``), which adds its own ``model`` section and defaults; YAML files under
``configs/`` hold overrides only, and every field can be overridden on the command line
(``train.global_batch_size=8 parallel.spatial=[2,1,1]``). Each component receives only
its own section.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from parallel.job.choices import (  # noqa: F401 - re-exported: callers import them from here
    Choice,
    ConvPath,
    DataCheck,
    Decay,
    DecayBoundary,
    Division,
    EvalAverage,
    EvalMode,
    MomentumForm,
    NonFinite,
    OptimName,
    Precision,
    Status,
    Usage,
)
from parallel.job.from_hydra import UnknownKeyError, to_dataclass, unknown_keys  # noqa: F401 - their home
from parallel.kfac.config import KFACConfig


@dataclass
class DataConfig:
    """Where the samples live and how they are read."""

    dir: str = "data"
    """Dataset root holding ``train/`` and ``val/`` (written by ``python -m <model>.prepare``)."""
    train_subdir: str = "train"
    """Training split, relative to ``data.dir``."""
    val_subdir: str = "val"
    """Validation split, relative to ``data.dir``."""
    stage_dir: Optional[str] = None
    """Node-local directory to stage this rank's share into before training (None: read in place)."""
    stage_blocks_only: bool = True
    """When staging, copy only this rank's blocks instead of whole samples."""
    stage_read_once: bool = False
    """When staging, read each file once per job (the nodes split the source's files and
    hand each other what they need over the CPU group) instead of once per node; the
    staged files are checked (size, SHA-256) before training (docs/data.md)."""
    max_open_files: int = 256
    """HDF5 files each reader process keeps open (least recently used closed first)."""
    workers: int = 1
    """Reader processes per rank (0: read in the training process)."""
    prefetch: int = 2
    """Batches each reader process reads ahead of the compute."""
    max_train_samples: int = 0
    """Use only the first N training samples (0: all); for quick experiments."""
    max_val_samples: int = 0
    """Use only the first N validation samples (0: all)."""
    check: DataCheck = DataCheck.quick
    """Before training, check the sample files (ranks share them): ``quick`` opens each and
    checks fields, dtypes, shapes, sample counts and the values of the small (scalar)
    fields; ``deep`` also reads every voxel; ``none`` skips the check."""
    nonfinite: NonFinite = NonFinite.fail
    """A training sample whose input block holds NaN or inf: ``fail`` stops with the file's
    name; ``skip`` leaves the sample out of its step and counts it (validation always fails)."""
    crop: Optional[list[int]] = None
    """Train on crops of this (D, H, W) (MLPerf U-Net: [128, 128, 128]), placed as the
    reference's RandBalancedCrop places them and read per rank (``parallel.data.crops``);
    None trains on whole samples, which must then share one shape per batch."""
    oversampling: float = 0.4
    """Probability that a crop is centred on a foreground component (MLPerf U-Net: 0.4)."""


@dataclass
class ParallelConfig:
    """The process grid."""

    spatial: Any = field(default_factory=lambda: [1, 1, 1])
    """Ways each sample is split along D, H, W; the data axis takes the remaining ranks.
    ``auto``: the split ``python -m parallel.plan`` predicts fastest among those that fit."""
    device_memory_gb: float = 0.0
    """Memory per rank that ``spatial=auto`` may plan for (0: the GPU's, or host RAM / local ranks)."""
    memory_limit: Any = None
    """Memory budget per rank: bytes, or a string such as ``3GiB`` or ``500MB`` (None: the
    device's memory on GPUs, no budget on CPUs). Before the first step the planner's
    predicted peak per rank must fit it, else the job stops (exit 2) with the prediction
    and the smallest split that fits; ``spatial=auto`` plans for it; on CPUs a rank whose
    resident memory goes over it stops the job (exit 2). ``parallel.train.checks.budget``,
    ``docs/performance.md`` ("A memory budget per rank")."""
    overlap_halo: Any = False
    """Run each split conv's halo exchange beside its block's convolution, forward and backward:
    ``true``, ``false``, or ``auto`` (per layer, where the calibration says the messages take
    longer than handing them to the halo thread; ``docs/performance.md``)."""
    channels_last: Any = "auto"
    """Lay activations out NDHWC (``torch.channels_last_3d``) from end to end: ``true``,
    ``false``, or ``auto`` (the default: on where it was measured faster, CPUs at fp32,
    ``parallel.split.layout.preferred``; off elsewhere until measured). The same numbers either
    way; checkpoints are unchanged. ``summary.json`` says which ran (``docs/performance.md``)."""
    conv_path: ConvPath = ConvPath.shell
    """How split convolutions run (``parallelize(..., conv_path=...)``): ``shell`` (the block
    convolved in place plus thin halo corrections: no copy, the path memory budgets are
    predicted for), ``window`` (block and halos copied into one window, one convolution: as
    LBANN DistConv and PhysicsNeMo run them; often faster on CPUs, a block-sized copy kept
    per layer), or ``auto`` (both timed per layer at its first step, the faster kept; the
    choice can differ between runs, so float32 results can differ in the last bits between
    a run and its resumption). All three equal the serial layer (``docs/performance.md``,
    "How the peers get their speed")."""
    timeout_s: float = 600.0
    """Bound on every collective, and how long a silent peer may go without a heartbeat:
    a dead or hung peer ends the job instead of hanging it."""
    heartbeat_s: float = 1.0
    """Period of the watchdog's heartbeat and checks (a dead peer on the same host, or a
    failure reported by any rank, stops every rank within about this long)."""
    backend: Optional[str] = None
    """torch.distributed backend (None: nccl on GPUs, gloo on CPUs)."""
    verify: Any = "auto"
    """Before the first step, check the split model against its serial self on a small probe
    and stop (exit 2) naming the first module that differs (``parallel.verify``): ``auto``
    when the model's own code runs in a forward (``custom_forwards``) or it is a
    ``model._target_`` network, and only with a spatial split; ``true`` always; ``false`` never."""


@dataclass
class TrainConfig:
    """The optimisation run."""

    global_batch_size: int = 64
    """Samples per optimiser step, over all data groups and accumulation micro-steps."""
    accum_steps: int = 1
    """Micro-batches per optimiser step (gradient accumulation); the global batch must divide by data size x this."""
    epochs: int = 128
    """Epochs to train at most."""
    max_steps: int = 0
    """Stop after this many optimiser steps in total (0: no limit)."""
    seed: int = 0
    """Seed of weights, shuffling and dropout."""
    resume: bool = False
    """Continue from ``run.dir/checkpoints/last.pt`` if it exists."""
    precision: Precision = Precision.fp32
    """Compute precision: fp32; bf16 autocast; fp16 autocast with a loss scaler (CPU or GPU:
    ``parallel.train.precision``); fp64: weights, samples and compute in float64, so that runs
    at different grids compare to ~1e-12 instead of float32 noise (its checkpoints hold
    float64 tensors; resuming one at fp32 casts them)."""
    tf32: bool = False
    """On GPUs, TF32 for float32 convolutions and matmuls: faster, but the split and serial
    runs then round differently (~1e-3 relative instead of ~1e-6; docs/training.md)."""
    eval_batch_size: int = 0
    """Samples per evaluation step over all data groups (0: train.global_batch_size)."""
    eval_every: int = 1
    """Evaluate every this many epochs (0: only at the end)."""
    eval_at_end: bool = True
    """Evaluate after the last step if the last evaluation was earlier."""
    target: Optional[float] = None
    """Quality target on the validation metric (None: the model's MLPerf target)."""
    stop_at_target: bool = True
    """End the run at the first evaluation that reaches the target."""
    grad_clip: float = 0.0
    """Clip the gradient's global norm to this (0: off)."""
    noise_scale: bool = True
    """Measure the gradient noise scale B_simple at every step (McCandlish et al. 2018) from
    the data groups' gradients, which the hierarchical gradient sync forms at no extra
    traffic (``parallel.model.gradsync``); in metrics.jsonl, TensorBoard and the summary
    (``docs/training.md``, "The gradient noise scale"). Needs two or more data groups; false:
    one all-reduce over every rank, nothing measured."""
    noise_scale_decay: float = 0.95
    """Decay of the running averages of |G|^2 and tr(Sigma) before their ratio is taken."""
    activation_checkpointing: bool = False
    """Keep only each block's input and recompute the block in the backward (less memory, ~1/3 more compute)."""
    profile: int = 0
    """Record a ``torch.profiler`` trace of this many steps, after one warm-up step, into
    ``run.dir/profile/rank<r>.json`` (one per rank; opens in Perfetto); 0: off
    (``parallel.train.observe.profile``, docs/performance.md)."""
    compile: Any = False
    """``torch.compile`` the split model: true (Inductor), false, or a backend name (``aot_eager``);
    refused, naming the reason, where it cannot run (``parallel.model.compiled``)."""
    nonfinite: NonFinite = NonFinite.fail
    """A step whose loss or gradients are NaN or inf: ``fail`` stops the run (the last
    checkpoint stays the last good one); ``skip`` drops the update and counts the step."""
    max_skipped_steps: int = 20
    """With ``nonfinite=skip``: stop after this many consecutive skipped steps."""
    inject_nonfinite: list[int] = field(default_factory=list)
    """Testing hook: at these (1-based) steps a NaN is put into one gradient after the sync,
    on some ranks only where a sharded weight allows (``parallel.train.step.inject_nonfinite``),
    to test that every rank takes the ``nonfinite`` decision alike. Empty in real runs."""
    replica_check_every: int = 100
    """Every this many steps, and before every checkpoint, compare a bit-exact digest of
    every parameter and its optimiser state over the ranks holding copies of it (the data
    replicas; for parameters not sharded in space, the spatial group too) and stop naming
    the step, the tensor and the odd rank on a mismatch (``parallel.train.replicas``,
    docs/failures.md); 0: off."""
    replay: bool = False
    """Replay a suspicious step once (a non-finite gradient norm, or a spike: see
    ``spike_factor``) from the state before it with the same batch and RNG streams: the
    same numbers mean the data or the model (the samples are named, ``nonfinite`` applies),
    others a transient fault (the ranks are named, training goes on with the replayed step)
    (``parallel.train.replay``, docs/failures.md). Not with K-FAC or fp16."""
    spike_factor: float = 0.0
    """With ``replay``: a step whose global gradient norm exceeds this many times its running
    average is suspicious too (0: only non-finite steps)."""


@dataclass
class OptimConfig:
    """The optimiser."""

    name: OptimName = OptimName.sgd
    """SGD with momentum (optionally Nesterov), AdamW, or K-FAC: SGD on gradients
    preconditioned by Kronecker-factored curvature (settings in ``optim.kfac``;
    ``docs/kfac.md``; MLPerf open division only)."""
    lr: float = 0.001
    """Base learning rate, before batch scaling and schedule."""
    lr_scale_batch: Optional[int] = None
    """If set, the peak LR is lr x global_batch_size / this (MLPerf CosmoFlow: 64)."""
    momentum: float = 0.9
    """SGD momentum."""
    nesterov: bool = False
    """Nesterov momentum for SGD."""
    weight_decay: float = 0.0
    """Decoupled for AdamW, L2 for SGD."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    momentum_form: MomentumForm = MomentumForm.torch
    """SGD momentum: ``torch`` (b = m b + g; p -= lr b) or ``keras`` (v = m v + lr g;
    p -= v: the learning rate inside the velocity, as the MLPerf HPC CosmoFlow reference
    and NVIDIA's port compute it; the two differ whenever the learning rate changes)."""
    decay_all: bool = False
    """Weight decay on every parameter; False: only on those the model family's reference
    decays (CosmoFlow: the two hidden dense weights), or all where the family names none."""
    kfac: KFACConfig = field(default_factory=KFACConfig)
    """K-FAC's settings (used with ``name=kfac``): damping, intervals, factor decay, KL
    clip, layer choice, precisions (``parallel.kfac.KFACConfig``)."""

    def peak_lr(self, global_batch_size: int) -> float:
        """The LR after warmup: ``lr``, scaled linearly with the batch if ``lr_scale_batch`` is set."""
        return self.lr * global_batch_size / self.lr_scale_batch if self.lr_scale_batch else self.lr


@dataclass
class ScheduleConfig:
    """Learning-rate schedule, evaluated at fractional epochs (step / steps per epoch)."""

    warmup_epochs: float = 0.0
    """Linear warmup length in epochs (0: none)."""
    warmup_start_lr: Optional[float] = None
    """LR at the start of warmup (None: the unscaled optim.lr, as in MLPerf CosmoFlow)."""
    decay: Decay = Decay.none
    """After warmup: constant, step decay at boundaries, or cosine to min_lr over train.epochs."""
    decay_epochs: list[int] = field(default_factory=list)
    """Step decay boundaries (epochs)."""
    decay_factors: list[float] = field(default_factory=list)
    """Peak-LR multiplier from each boundary on; factors replace each other, they do not multiply."""
    min_lr: float = 0.0
    """Final LR of the cosine decay."""
    per_epoch: bool = False
    """Hold the LR for a whole epoch, set from the epoch number at its start (the MLPerf
    references: Keras' LearningRateScheduler for CosmoFlow, the U-Net's per-epoch warmup);
    False moves it at every step (fractional epochs)."""
    warmup_epoch_offset: int = 0
    """With ``per_epoch``: epoch ``e`` (0-based) of the warmup runs at
    start + (peak - start) (e + offset) / warmup_epochs. 0: CosmoFlow's reference (the
    first epoch at the start LR); 1: the U-Net's (1-based epochs: the first at
    start + (peak - start) / warmup_epochs, the last warmup epoch at the peak)."""
    decay_boundary: DecayBoundary = DecayBoundary.at
    """Step decay: ``at`` applies a boundary's factor from epoch ``b`` on (0-based, as
    torch's MultiStepLR and NVIDIA's CosmoFlow port); ``after`` from epoch ``b + 1``, as
    the MLPerf HPC reference (its schedule takes the factor of boundaries ``b < epoch``)."""


@dataclass
class EvalConfig:
    """How the validation metric is computed (cadence: ``train.eval_every``)."""

    mode: EvalMode = EvalMode.whole
    """``sliding``: the MLPerf U-Net's Gaussian-weighted sliding window over each case,
    split across the spatial group (``parallel.infer``); ``whole``: one pass over each
    whole sample (this project's extension; not the MLPerf U-Net metric)."""
    window: Optional[list[int]] = None
    """Sliding window (D, H, W); None: ``data.crop`` (the reference's window is the crop)."""
    overlap: float = 0.5
    """Fraction of a window its neighbour overlaps (MLPerf: 0.5, stride = window / 2)."""
    pad_value: float = -2.2
    """Value of the padding around a case (MLPerf KiTS19: -2.2, normalised air)."""
    sigma_scale: float = 0.125
    """Sigma of each 1-D Gaussian of the importance map, as a fraction of the window."""
    start_epoch: int = 0
    """First (1-based) epoch to evaluate after; then every ``train.eval_every`` epochs
    (MLPerf U-Net: 1000, every 20). 0: whenever the epoch is a multiple of eval_every."""
    average: EvalAverage = EvalAverage.cases
    """How the metric is averaged: ``cases`` (every case weighs the same, at any grid) or
    ``groups`` (the mean of each data group's mean over its contiguous share of the cases,
    as the MLPerf U-Net reference averages its ranks' means; the two differ only when the
    data groups hold unequal numbers of cases)."""


@dataclass
class RunConfig:
    """Outputs and reporting."""

    dir: str = "runs/default"
    """Run directory: checkpoints/, metrics.jsonl, TensorBoard events, mlperf.log, summary.json.
    The configs date it (``runs/<model>/${now:...}``); one that already holds a run is
    refused unless ``train.resume`` or ``run.overwrite`` (``parallel.train.persist.rundir``)."""
    overwrite: bool = False
    """Start afresh in a ``run.dir`` that holds a run: its files move to ``run.dir/previous_<k>/``."""
    checkpoint_every: int = 0
    """Also write ``last.pt`` every this many steps (0: only at epoch ends and at the end)."""
    keep_checkpoints: int = 1
    """Checkpoints kept: ``last.pt`` and, when above 1, the newest N as ``step_<step>.pt``."""
    # -- bounded loss of work (parallel.train.persist.writer.Writer, docs/failures.md) --
    checkpoint_every_s: float = 0.0
    """Also write ``last.pt`` once this many seconds of wall time passed since the last one
    (0: off); rank 0's clock decides for every rank. Bounds the work a dead node costs."""
    checkpoint_background: bool = True
    """Write checkpoints in a background thread from a CPU copy of the state taken at the
    step boundary (training goes on during the write); false: the step waits for the write."""
    log_every: int = 10
    """Write a metrics.jsonl line and TensorBoard scalars every this many steps."""
    progress: bool = True
    """Show a progress bar on the speaking rank."""
    log_rank: int = -2
    """Rank whose logger speaks (-1: all ranks; -2: rank 0, or from env LOG_RANK)."""
    log_level: str = "INFO"
    """Logging level of the framework's logger."""
    tensorboard: bool = True
    """Write TensorBoard events."""
    stop_signal: Optional[str] = None
    """Signal (e.g. ``USR1``: Slurm's ``--signal=B:USR1@N`` before a time limit) on which the
    run writes its checkpoint after the current step and stops, to be resumed with
    ``train.resume=true`` (``parallel.train.stopsignal``). None: off."""


@dataclass
class MLPerfConfig:
    """MLPerf logging (``run.dir/mlperf.log``)."""

    enabled: bool = True
    """Write the MLPerf log."""
    benchmark: str = ""
    """Benchmark name in the log (default: the model family's)."""
    org: str = "spatialcnn"
    """submission_org."""
    division: Division = Division.closed
    """submission_division."""
    status: Status = Status.research
    """submission_status."""
    platform: str = "cpu"
    """submission_platform."""
    usage: Optional[Usage] = None
    """Ruleset family of the log: ``hpc`` (CosmoFlow, HPC 3.0.0) or ``training`` (the
    U-Net, Training 4.0.0: its key names); None: ``hpc``. Each family's job sets its own."""


@dataclass
class JobConfig:
    """A whole training job; each model's entry point subclasses it with its ``model`` section."""

    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sched: ScheduleConfig = field(default_factory=ScheduleConfig)
    run: RunConfig = field(default_factory=RunConfig)
    mlperf: MLPerfConfig = field(default_factory=MLPerfConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    model: Any = None
