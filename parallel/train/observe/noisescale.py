"""The gradient noise scale of a run, measured at every step from its data groups.

McCandlish et al. ("An Empirical Model of Large-Batch Training", arXiv 1812.06162): with
the true gradient G and the per-sample covariance Sigma, a batch of B samples gives
``E |G_B|^2 = |G|^2 + tr(Sigma) / B``. Every step of a run with D >= 2 data groups holds
gradients at two batch sizes: each data group's (``B_small = B / D`` samples) and their
mean, the synchronised gradient (``B_big = B``). The sync forms the data groups' gradients
on the way (``parallel.model.gradsync``, the hierarchical sync) and sums their squared
norms; ``|G_small|^2`` is their mean over the data groups, ``|G_big|^2`` the synchronised
gradient's (the global norm the step already takes, ``parallel.train.gradnorm``), a
spatially sharded weight counted once in both. The unbiased estimates

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

are each kept as a running average (an exponential one with its start-up bias taken out,
``train.noise_scale_decay``, and the plain mean over the run) before their ratio, the
simple noise scale ``B_simple = tr(Sigma) / |G|^2``, is taken (single-step ratios are
dominated by noise: the paper averages first).

What the gradients are: the raw gradients of the step's loss, after the backward summed
the accumulation micro-batches (a data group's gradient covers its whole share of the
batch, so accumulation changes nothing), before clipping (``train.grad_clip`` scales them
afterwards), with the fp16 loss scale divided out (a step whose gradients overflowed is
not measured), and before K-FAC preconditions them (the noise scale of the plain gradient,
as the paper defines it). With one data group there is no second batch size in a step:
the run says so and measures nothing. Samples left out of a step (``data.nonfinite=skip``)
make that step's batches smaller than the nominal sizes used here.
"""

from __future__ import annotations

import math
from typing import Any

ONE_GROUP = ("one data group: the gradient noise scale needs two or more (each step's data-group "
             "gradients against their mean); run with more data groups (a smaller parallel.spatial "
             "split) to measure it")
OFF = "train.noise_scale=false"


class NoiseScale:
    """The running estimate of one run.

    ``global_batch``: samples per step (``B_big``); ``data_size``: data groups (each
    holds ``B_small = global_batch / data_size``); ``decay``: of the exponential averages;
    ``enabled``: ``train.noise_scale``.
    """

    def __init__(self, global_batch: int, data_size: int, decay: float = 0.95, enabled: bool = True) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"train.noise_scale_decay={decay}: the running average's decay must be in [0, 1)")
        self.b_big = float(global_batch)
        self.b_small = float(global_batch) / max(data_size, 1)
        self.decay = decay
        self.why_not = None if enabled and data_size > 1 else (OFF if not enabled else ONE_GROUP)
        self.steps = 0
        self.last: dict[str, float] = {}
        self._ema = [0.0, 0.0]    # |G|^2, tr(Sigma)
        self._weight = 0.0        # the exponential average's total weight (its start-up bias)
        self._sums = [0.0, 0.0]

    @property
    def measured(self) -> bool:
        return self.why_not is None

    def estimates(self, small_sq: float, big_sq: float) -> tuple[float, float]:
        """(|G|^2, tr(Sigma)) of one step, unbiased, from its two squared norms."""
        bs, bb = self.b_small, self.b_big
        g2 = (bb * big_sq - bs * small_sq) / (bb - bs)
        trace = (small_sq - big_sq) / (1.0 / bs - 1.0 / bb)
        return g2, trace

    def update(self, small_sq: float, big_sq: float) -> None:
        """One step's ``|G_small|^2`` (the data groups' mean) and ``|G_big|^2``."""
        if not (math.isfinite(small_sq) and math.isfinite(big_sq)):
            return
        g2, trace = self.estimates(small_sq, big_sq)
        self.steps += 1
        self._weight = self.decay * self._weight + (1.0 - self.decay)
        for k, v in enumerate((g2, trace)):
            self._ema[k] = self.decay * self._ema[k] + (1.0 - self.decay) * v
            self._sums[k] += v
        g2_avg, trace_avg = self.averages()
        self.last = {"grad_sq_small": small_sq, "grad_sq_big": big_sq, "grad_sq_est": g2, "grad_var_est": trace,
                     "grad_sq_avg": g2_avg, "grad_var_avg": trace_avg}

    def averages(self) -> tuple[float, float]:
        """The running (exponential, bias-corrected) averages of |G|^2 and tr(Sigma)."""
        if self._weight == 0.0:
            return math.nan, math.nan
        return self._ema[0] / self._weight, self._ema[1] / self._weight

    @staticmethod
    def ratio(trace: float, g2: float) -> float | None:
        """``B_simple``; None while the |G|^2 estimate is not positive (noise dominates it)."""
        return trace / g2 if g2 > 0 and math.isfinite(trace) else None

    def b_simple(self) -> float | None:
        """From the running averages."""
        g2, trace = self.averages()
        return self.ratio(trace, g2)

    def log_values(self) -> dict[str, Any]:
        """The last step's figures, prefixed ``noise_``, for a metrics row (none before a
        measured step, or when nothing is measured)."""
        if not self.last:
            return {}
        out = {f"noise_{k}": v for k, v in self.last.items()}
        out["noise_b_simple"] = self.b_simple()
        return out

    def summary(self) -> dict[str, Any]:
        """The run's figures for ``summary.json``."""
        if not self.measured:
            return {"measured": False, "why": self.why_not}
        out: dict[str, Any] = {"measured": True, "b_small": self.b_small, "b_big": self.b_big,
                               "steps": self.steps, "decay": self.decay}
        if self.steps:
            g2, trace = self.averages()
            mean_g2, mean_trace = self._sums[0] / self.steps, self._sums[1] / self.steps
            out.update({"grad_sq_avg": g2, "grad_var_avg": trace, "b_simple": self.ratio(trace, g2),
                        "grad_sq_run_mean": mean_g2, "grad_var_run_mean": mean_trace,
                        "b_simple_run_mean": self.ratio(mean_trace, mean_g2), "last": dict(self.last)})
        return out

    def line(self) -> str:
        """One human line for the log's summary."""
        if not self.measured:
            return f"gradient noise scale: not measured ({self.why_not})"
        s = self.summary()
        if not self.steps:
            return "gradient noise scale: no step measured"
        fmt = (lambda v: "n/a (|G|^2 estimate not positive)" if v is None else f"{v:.4g}")
        return (f"gradient noise scale B_simple: {fmt(s['b_simple'])} (running average), "
                f"{fmt(s['b_simple_run_mean'])} (run mean), from {self.steps} steps at batches "
                f"{self.b_small:g} and {self.b_big:g}")
