"""The fixed-choice values of the job config (``parallel.job.config``'s Enum fields).

OmegaConf validates Enums, not Literals, so each field with a fixed set of values is one
of these; members compare equal to, print as and serialise as their string value.
"""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A config field with a fixed set of values (OmegaConf validates Enums, not Literals).

    Members compare equal to, print as and serialise as their string value.
    """

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Precision(Choice):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    fp64 = "fp64"


class OptimName(Choice):
    sgd = "sgd"
    adamw = "adamw"
    kfac = "kfac"


class Decay(Choice):
    none = "none"
    step = "step"
    cosine = "cosine"


class NonFinite(Choice):
    fail = "fail"
    skip = "skip"


class ConvPath(Choice):
    shell = "shell"
    window = "window"
    auto = "auto"


class DataCheck(Choice):
    none = "none"
    quick = "quick"
    deep = "deep"


class Division(Choice):
    closed = "closed"
    open = "open"


class MomentumForm(Choice):
    torch = "torch"
    keras = "keras"


class DecayBoundary(Choice):
    at = "at"
    after = "after"


class EvalMode(Choice):
    sliding = "sliding"
    whole = "whole"


class EvalAverage(Choice):
    cases = "cases"
    groups = "groups"


class Usage(Choice):
    hpc = "hpc"
    training = "training"


class Status(Choice):
    onprem = "onprem"
    cloud = "cloud"
    research = "research"
    preview = "preview"
