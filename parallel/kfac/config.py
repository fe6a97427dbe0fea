"""Settings of K-FAC, one dataclass the training config can embed (``optim.kfac``).

Damping 1e-3, decay 0.95 and KL clipping 1e-3 are the usual K-FAC values for CNNs. The
intervals are set by cost: accumulating a convolution's A factor is a Gram product over
every output position, ~(Cin k^3 / Cout) times the layer's own forward; on CosmoFlow at
128^3 one factor update costs ~3.6 SGD steps of compute, so it runs every 10th step and
the eigendecompositions every 100th (``docs/kfac.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch


class Dtype(str, Enum):
    """A precision of factors or eigendecompositions (an Enum, which OmegaConf validates)."""

    float32 = "float32"
    float64 = "float64"
    bfloat16 = "bfloat16"
    float16 = "float16"
    auto = "auto"

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @property
    def torch(self) -> torch.dtype:
        if self is Dtype.auto:
            raise ValueError("kfac: the precision 'auto' follows the weights: resolve it with KFACConfig.dtypes()")
        return getattr(torch, self.value)

    def resolve(self, weights: torch.dtype) -> torch.dtype:
        """This precision, ``auto`` taking float64 for float64 weights and float32 otherwise."""
        if self is Dtype.auto:
            return torch.float64 if weights == torch.float64 else torch.float32
        return self.torch


class WideFactors(str, Enum):
    """What a layer whose factor is wider than ``max_factor_dim`` gets."""

    lowrank = "lowrank"
    plain = "plain"

    def __str__(self) -> str:
        return str(self.value)


@dataclass
class KFACConfig:
    """Kronecker-factored preconditioning of Conv3d, ConvTranspose3d and Linear gradients."""

    damping: float = 1e-3
    """Tikhonov damping added to the Kronecker product's eigenvalues: the preconditioner is
    ``(G x A + damping I)^-1`` (exact, through both eigenbases)."""
    factor_interval: int = 10
    """Accumulate the factors A and G (and all-reduce them) every this many steps."""
    inverse_interval: int = 100
    """Recompute the eigendecompositions every this many steps (a multiple of
    ``factor_interval``, so they always see freshly updated factors)."""
    factor_decay: float = 0.95
    """Running average of the factors: ``F = decay F + (1 - decay) F_new`` (the first
    update takes ``F_new`` as it is)."""
    kl_clip: float = 1e-3
    """Scale every preconditioned gradient by ``min(1, sqrt(kl_clip / |sum lr^2 v.g|))``, a
    bound on the step's predicted change of the model's output distribution (0: off)."""
    include: list[str] = field(default_factory=list)
    """``fnmatch`` patterns on module names (``"net.*"``) of the layers to precondition
    (empty: every Conv3d, ConvTranspose3d and Linear)."""
    exclude: list[str] = field(default_factory=list)
    """Patterns of layers that take the plain update even if ``include`` matches them."""
    max_factor_dim: int = 4096
    """Widest factor held densely: the eigendecomposition costs ~9 d^3 flops and d^2
    memory on every rank. A wider one is held as low rank plus diagonal
    (``wide_factors``). CosmoFlow's first Linear at 128^3 input has a 32769-wide A; its
    fifth conv a 6913-wide one."""
    wide_factors: WideFactors = WideFactors.lowrank
    """A factor wider than ``max_factor_dim``: ``lowrank`` holds it as ``U diag(lam) U^T +
    diag(D)`` from a randomized sketch, memory linear in its width
    (``parallel.kfac.lowrank``); ``plain``: the layer takes the plain update. A layer with
    both factors that wide takes the plain update either way."""
    rank: int = 128
    """Rank of a low-rank factor (at most its width: at its width it is the dense factor)."""
    oversample: int = 16
    """Extra columns of the sketch beyond ``rank`` (the range finder's oversampling)."""
    flat_blocks: list[int] = field(default_factory=list)
    """``[sd, sh, sw]``: a Flatten+Linear whose A is wider than ``max_factor_dim`` holds it in
    the hierarchical form, the blocks of this split of its input volume as dense diagonal
    blocks plus the low-rank coupling (``lowrank.Blocked``); empty: low rank plus diagonal.
    A setting, not the grid's split, so that every grid computes the same form; where it
    matches or refines the grid's split, the weight is sharded and each rank holds only its
    own blocks (``parallel.kfac.local``)."""
    rank_tol: float = 0.0
    """Eigenvalues of a low-rank factor below this times its largest are dropped (their
    mass goes to the diagonal; 0: none); the kept rank is logged at each inverse update."""
    factor_dtype: Dtype = Dtype.auto
    """Precision in which the factors are accumulated, reduced and averaged; ``auto``:
    float64 when the preconditioned weights are float64 (``train.precision=fp64``),
    float32 otherwise."""
    inverse_dtype: Dtype = Dtype.auto
    """Precision of the eigendecompositions and of the preconditioning products (float32
    or float64: eigensolvers do not run in half precision; ``auto`` as for the factors)."""
    chunk_mb: float = 64.0
    """Largest block of convolution patches formed at once while accumulating A (MiB)."""
    position_stride: int = 1
    """A convolution's A from the output positions whose global coordinates are multiples
    of this in every dim (about ``1/s^3`` of the Gram work; 1: every position). The same
    positions at every grid (``parallel.kfac.subsample``)."""
    stale_tol: float = 0.0
    """Lengthen the interval between factor updates while the factors change by less than
    this between updates (relative, largest over layers), shorten it above twice this; the
    change is measured and reported either way (0: the interval stays ``factor_interval``)."""
    max_factor_interval: int = 0
    """Longest interval ``stale_tol`` may choose (0: ``inverse_interval``)."""
    gram_dtype: Dtype = Dtype.auto
    """Precision in which convolution patches are multiplied for A (bfloat16: faster where
    the hardware multiplies it natively; not float16, whose range the sums overflow), each
    slab's product added into ``factor_dtype``; ``auto``: ``factor_dtype``."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the setting and its value when one is out of range."""
        if not self.damping > 0:
            raise ValueError(f"kfac.damping must be > 0, got {self.damping}")
        if self.factor_interval < 1 or self.inverse_interval < 1:
            raise ValueError(f"kfac.factor_interval ({self.factor_interval}) and kfac.inverse_interval "
                             f"({self.inverse_interval}) must be >= 1")
        if self.inverse_interval % self.factor_interval:
            raise ValueError(f"kfac.inverse_interval ({self.inverse_interval}) must be a multiple of "
                             f"kfac.factor_interval ({self.factor_interval})")
        if not 0.0 <= self.factor_decay < 1.0:
            raise ValueError(f"kfac.factor_decay must be in [0, 1), got {self.factor_decay}")
        if self.kl_clip < 0:
            raise ValueError(f"kfac.kl_clip must be >= 0 (0: off), got {self.kl_clip}")
        if self.max_factor_dim < 1:
            raise ValueError(f"kfac.max_factor_dim must be >= 1, got {self.max_factor_dim}")
        if str(self.wide_factors) not in WideFactors.__members__:
            raise ValueError(f"kfac.wide_factors must be one of {', '.join(WideFactors.__members__)}, "
                             f"got {str(self.wide_factors)!r}")
        self.wide_factors = WideFactors(str(self.wide_factors))
        if self.rank < 1 or self.oversample < 0:
            raise ValueError(f"kfac.rank must be >= 1 and kfac.oversample >= 0, got {self.rank} and {self.oversample}")
        if self.flat_blocks and (len(self.flat_blocks) != 3 or min(self.flat_blocks) < 1):
            raise ValueError(f"kfac.flat_blocks must be empty or three splits >= 1 (D, H, W), got "
                             f"{list(self.flat_blocks)}")
        if not 0.0 <= self.rank_tol < 1.0:
            raise ValueError(f"kfac.rank_tol must be in [0, 1), got {self.rank_tol}")
        if not self.chunk_mb > 0:
            raise ValueError(f"kfac.chunk_mb must be > 0, got {self.chunk_mb}")
        if self.position_stride < 1:
            raise ValueError(f"kfac.position_stride must be >= 1 (1: every position), got {self.position_stride}")
        if self.stale_tol < 0 or self.max_factor_interval < 0:
            raise ValueError(f"kfac.stale_tol ({self.stale_tol}) and kfac.max_factor_interval "
                             f"({self.max_factor_interval}) must be >= 0 (0: off / inverse_interval)")
        for name in ("factor_dtype", "inverse_dtype", "gram_dtype"):
            value = str(getattr(self, name))
            if value not in Dtype.__members__:
                raise ValueError(f"kfac.{name} must be one of {', '.join(Dtype.__members__)}, got {value!r}")
            setattr(self, name, Dtype(value))
        if self.gram_dtype is Dtype.float16:
            raise ValueError("kfac.gram_dtype=float16 overflows the Gram products (a slab's sums pass 65504: "
                             "infinite factors on CosmoFlow's first layer): use bfloat16")
        if self.inverse_dtype not in (Dtype.float32, Dtype.float64, Dtype.auto):
            raise ValueError(f"kfac.inverse_dtype must be float32, float64 or auto (eigendecompositions), "
                             f"got {self.inverse_dtype}")

    def product_dtype(self, factor: torch.dtype) -> torch.dtype:
        """The precision of the A Gram products for factors in ``factor`` precision."""
        return factor if Dtype(str(self.gram_dtype)) is Dtype.auto else Dtype(str(self.gram_dtype)).torch

    def dtypes(self, weights: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """(factor, inverse) precisions for preconditioned weights of dtype ``weights``."""
        return Dtype(str(self.factor_dtype)).resolve(weights), Dtype(str(self.inverse_dtype)).resolve(weights)
