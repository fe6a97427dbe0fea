"""``train.compile``: the split model under ``torch.compile``, or a refusal that says why.

``train.compile=true`` compiles the converted model in place with TorchInductor
(``nn.Module.compile``: the parameters, the state_dict keys and the checkpoints stay the
serial model's); ``train.compile=<backend>`` names another of
``torch.compiler.list_backends(exclude_tags=None)`` (``aot_eager`` traces forward and
backward through AOT autograd without generating code: the tests' choice, since
Inductor's first C++ build takes minutes on a small CPU). The halo exchanges are
``torch.autograd.Function``s sending point-to-point messages, which Dynamo does not
trace: the graph breaks there, the exchanges run eagerly, and the computation between
them is compiled. A plain all-reduce or all-gather (the split layers' sums, the block
sizes) Dynamo may trace into a graph as a functional collective. The gradient sync's
hooks run in the backward as before. The start-up verification (``parallel.verify``)
checks the eager model; the tests check compiled against eager.

Refused before the job starts (``ConfigError``, exit 2), naming the reason: a backend
this torch does not have; Inductor on the CPU without a C++ compiler on PATH (it builds
its kernels with one); K-FAC (its hooks capture each layer's inputs and output
gradients: not proven under compilation). ``train.activation_checkpointing`` compiles
too (the tests compare it with eager).
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import torch
from torch import nn

from parallel.comm.timing import keep_out_of_compile

log = logging.getLogger("parallel.train")

COMPILERS = ("c++", "g++", "clang++")
"""What Inductor's CPU code generation calls (``CXX`` first, where set)."""


def backend_of(value: Any) -> Any:
    """The backend ``train.compile`` asks for: a name, a callable (a backend of one's own, as
    ``torch.compile`` takes it), or None (off)."""
    if callable(value):
        return value
    if value is False or value is None or str(value).lower() in ("false", "off", "none", ""):
        return None
    if value is True or str(value).lower() == "true":
        return "inductor"
    return str(value)


def refusal(value: Any, optimizer: str, device_type: str = "cpu") -> str | None:
    """Why ``train.compile=value`` cannot run here (None: it can)."""
    backend = backend_of(value)
    if backend is None or callable(backend):
        return None
    key = f"train.compile={str(value).lower() if isinstance(value, bool) else value}"  # as typed
    known = torch.compiler.list_backends(exclude_tags=None)  # aot_eager is tagged "debug"
    if backend not in known:
        usual = sorted(set(torch.compiler.list_backends()) | {"aot_eager"})  # not the debugging ones
        return f"{key}: torch {torch.__version__} has no compile backend {backend!r}; choose true (inductor), " \
               f"one of {', '.join(usual)}, or false"
    if backend == "inductor" and device_type == "cpu":
        wanted = [os.environ["CXX"]] if os.environ.get("CXX") else list(COMPILERS)
        if not any(shutil.which(c) for c in wanted):
            return (f"{key}: Inductor builds its CPU kernels with a C++ compiler and none of "
                    f"{', '.join(wanted)} is on PATH; install one (g++), or use train.compile=aot_eager "
                    "(traced, no code generation) or train.compile=false")
    if optimizer == "kfac":
        return f"{key} with optim.name=kfac: K-FAC's hooks capture each layer's inputs and output gradients, " \
               "which is not proven under torch.compile; use one or the other"
    return None


def compile_model(pmodel: nn.Module, value: Any) -> None:
    """Compile ``pmodel``'s converted network in place (``ParallelModule.module``): the
    ParallelModule's own bookkeeping (the gradient sync's buffers, the input's block sizes)
    stays eager, and so do the exchanges, where the graph breaks."""
    backend = backend_of(value)
    if backend is None:
        return
    keep_out_of_compile()  # the step-time regions' clocks stay outside the graphs
    inner = getattr(pmodel, "module", pmodel)
    inner.compile(backend=backend)
    log.info("train.compile: the split model compiled with %s (the graph breaks at each halo exchange; "
             "the first steps take the compilation)", getattr(backend, "__name__", backend))
