"""The start method of the test pools' rank processes (``harness.RankPool``,
``jobpool.JobPool``): forked from a fork server that imported torch and the training
stack once, so a pool, and every pool a failure replaces, starts in a fraction of a
second instead of ~3 CPU-seconds a rank (a fresh interpreter importing torch, torch's
``_dynamo``, Hydra and the loop). Each rank is still a new process that never ran a case
or job. GPU runs (``SPATIALCNN_TEST_DEVICE=cuda``) and ``SPATIALCNN_TEST_START=spawn``
start fresh interpreters instead."""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

# what a rank would import before its first case or job (the fork server imports them once)
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "hydra", "omegaconf", "h5py", "parallel.comm",
           "parallel.grid", "cosmoflow.family", "unet3d.family", "parallel.train.lifecycle", "parallel.train.cli",
           "parallel.train.loop", "parallel.train.observe.mlperf", "parallel.train.observe.report"]


def context() -> Any:
    """``forkserver`` with ``PRELOAD``, or ``spawn`` (GPUs, or where asked)."""
    start = os.environ.get("SPATIALCNN_TEST_START", "forkserver")
    if start not in ("forkserver", "spawn"):
        raise ValueError(f"SPATIALCNN_TEST_START={start!r}: expected forkserver or spawn")
    if (start == "spawn" or os.environ.get("SPATIALCNN_TEST_DEVICE", "cpu") != "cpu"
            or "forkserver" not in mp.get_all_start_methods()):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
