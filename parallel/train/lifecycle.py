"""The process around a training job: start, failure and end.

``train(cfg, family)`` is collective: every rank of the job calls it with the same
config. It reads top to bottom, each step a plain call that hands its result down:

1. the checks that need no process group (``parallel.train.checks.before_grid``: the
   config's values, the sample facts, the network at its volume): a ``JobPlan``;
2. the process group and the grid (``parallel.spatial=auto``: rank 0 asks the planner
   with the plan's facts; an elastic restart keeps or re-chooses the split);
3. the run directory settled (``parallel.train.persist.rundir``), the elastic session
   recorded, the watchdog and the threads;
4. the job built on the grid and run (``parallel.train.job.run_job``): its summary.

It ends the process: 0 after a clean end, 2 for bad input or config, 1 for anything
else, after one clear message; with several ranks the watchdog makes every rank stop,
naming the rank that failed (``docs/failures.md``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, NoReturn

import torch

from parallel import comm
from parallel.data.reader import SampleReadError
from parallel.grid import Grid
from parallel.job import checkpoint
from parallel.job.config import JobConfig, ParallelConfig
from parallel.job.errors import ConfigError, InputError
from parallel.job.family import Family
from parallel.partition import SplitError
from parallel.runtime.launch import RendezvousError, destroy, env_rank, init, init_count
from parallel.runtime.watchdog import Watchdog
from parallel.train import elastic
from parallel.train.checks import JobPlan, before_grid, is_auto
from parallel.train.checks.autosplit import auto_spatial
from parallel.train.job import run_job
from parallel.train.observe.report import setup_logging
from parallel.train.persist import rundir
from parallel.train.persist.writer import Writer
from parallel.train.replicas import ReplicaMismatchError
from parallel.train.step import NonFiniteError

log = logging.getLogger("parallel.train")

EXIT_USER = 2
"""Exit status for bad input or config (the message says what to change)."""
EXIT_FAILURE = 1
"""Exit status for anything else."""

# Failures reported as one line (the message says what and where); anything else is
# logged with its traceback, since it is probably a bug.
CLEAN_ERRORS = (InputError, checkpoint.CheckpointError, SampleReadError, SplitError,
                FileNotFoundError, PermissionError, NonFiniteError, ReplicaMismatchError)


def train(cfg: JobConfig, family: Family, config_text: str | None = None) -> dict[str, Any]:
    """Run a training job from ``cfg``; returns the summary (on every rank).

    Any failure ends the process with a non-zero status (see the module docstring).
    ``config_text``: the resolved config, saved as ``run.dir/config.yaml`` once the run
    directory is settled and a resume is known to proceed. A failure alike on every rank
    (bad config or data) ends with ``SystemExit`` on every rank, together, so every
    launcher reports its status (2) and a sweep run in these processes goes on to its next job.
    """
    setup_logging(cfg.run, env_rank())
    plan = _before_grid(cfg, family)
    cfg.train.resume = elastic.resumes(cfg.train.resume, cfg.run.dir)  # a restart resumes by itself
    grid = _start_grid(cfg, family, plan)
    watchdog = None
    try:
        setup_logging(cfg.run, grid.rank)
        cfg.run.dir = _settle_run_dir(cfg.run.dir, cfg.train.resume, cfg.run.overwrite, grid)
        regrid = elastic.regrid(cfg.train, cfg.run.dir, grid)  # torchrun: accumulation for this world
        if regrid is not None:
            cfg.train.accum_steps = regrid.current.accum_steps
        watchdog = _start_watchdog(cfg.parallel, cfg.run.dir, grid)
        _set_threads(grid)
        writer = Writer(background=cfg.run.checkpoint_background)
        if watchdog is not None:  # a write in flight ends before a failure ends the process (bounded)
            watchdog.before_exit = lambda: writer.drain(min(60.0, cfg.parallel.timeout_s))
        save = lambda: _save_config(cfg.run.dir, cfg.train.resume, grid, config_text)  # noqa: E731
        summary = run_job(cfg, family, grid, plan, writer, regrid, save, watchdog)
    except BaseException as exc:  # noqa: BLE001 - every failure ends the job, loudly
        _fail(exc, grid, watchdog)
    if watchdog is not None:
        watchdog.stop()  # before the barrier: nobody watches a peer that has left
    destroy(cfg.parallel.timeout_s)  # waits for every rank before the group goes
    return summary


def _before_grid(cfg: JobConfig, family: Family) -> JobPlan:
    """``checks.before_grid``; a bad config or sample set ends every rank alike with exit 2
    (rank 0 says why), before any process group starts."""
    try:
        return before_grid(cfg, family)
    except InputError as err:
        if env_rank() == 0:  # every rank finds the same: one message
            log.error("bad config: %s" if isinstance(err, ConfigError) else "%s", err)
        raise SystemExit(EXIT_USER) from err


def _start_grid(cfg: JobConfig, family: Family, plan: JobPlan) -> Grid:
    """The process group and the grid of ``parallel.spatial`` (``auto``: rank 0 asks the
    planner with the plan's facts, once the world is known); exit 2 where the grid does
    not fit the world or the rendezvous cannot start."""
    auto = is_auto(cfg.parallel.spatial)

    def decide(world: Any) -> list[int]:  # rank 0, once the process group runs
        return auto_spatial(cfg, family, plan.facts, world_size=world.world_size, local_size=world.max_ranks_per_node)

    try:
        spatial: Any = elastic.spatial_choice(cfg.parallel.spatial, decide)  # at a restart, re-chosen if it no longer fits
        grid = init(spatial, backend=cfg.parallel.backend, timeout_s=cfg.parallel.timeout_s, tf32=cfg.train.tf32)
    except RendezvousError as err:  # before any process group: every rank says so and leaves at once
        log.error("%s", err)
        raise SystemExit(EXIT_USER) from err
    except ValueError as err:  # the grid does not fit the world size, or auto found no split
        if env_rank() == 0:  # every rank finds the same: one message
            log.error("bad config: parallel.spatial=%s: %s", "auto" if auto else list(cfg.parallel.spatial), err)
        destroy()
        raise SystemExit(EXIT_USER) from err
    if auto:
        log.info("parallel.spatial=auto chose %s for %d ranks (parallel.plan)", "x".join(map(str, grid.spatial)),
                 grid.world_size)
    return grid


def _set_threads(grid: Grid) -> None:
    """CPU ranks share the host's cores unless ``OMP_NUM_THREADS`` says otherwise."""
    if grid.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(grid.local_size, 1)))


def _settle_run_dir(run_dir: str, resume: bool, overwrite: bool, grid: Grid) -> str:
    """``run.dir`` as every rank takes it: rank 0 applies the run-directory rule
    (``rundir.prepare``: refuse a used one, move it aside, or resume in it) before anything
    is written, and every rank takes rank 0's answer (a dated one may differ by a second)
    or raises its refusal alike."""
    answer: dict[str, str] = {"dir": run_dir}
    if grid.rank == 0:
        try:
            answer["note"] = rundir.prepare(run_dir, resume, overwrite)
        except rundir.RunDirError as err:
            answer["error"] = str(err)
    if grid.world_size > 1:
        raw = comm.all_gather_bytes(json.dumps(answer).encode(), grid.world_group, caller="lifecycle.run_dir")
        answer = json.loads(raw[0].decode())
    if "error" in answer:
        raise rundir.RunDirError(answer["error"])
    log.info("%s", answer.get("note", answer["dir"]))
    return answer["dir"]


def _save_config(run_dir: str, resume: bool, grid: Grid, config_text: str | None) -> None:
    """Rank 0 writes ``run_dir/config.yaml``; a resumed run keeps the earlier session's
    as ``config.yaml.<k>`` when the settings differ."""
    if grid.rank == 0 and config_text is not None:
        path = Path(run_dir) / "config.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume and path.is_file() and path.read_text(encoding="utf-8") != config_text:
            k = 1
            while path.with_name(f"config.yaml.{k}").exists():
                k += 1
            path.rename(path.with_name(f"config.yaml.{k}"))  # the earlier session's settings stay
        path.write_text(config_text, encoding="utf-8")


def _start_watchdog(par: ParallelConfig, run_dir: str, grid: Grid) -> Watchdog | None:
    """The watchdog of a multi-rank job (``par``: the parallel section's timeout and
    heartbeat); rank 0 writes ``run_dir/ranks.json`` (host, pid)."""
    address = grid.store_address
    if grid.world_size == 1 or address is None:
        return None
    # the restart of torchrun's agent, and the job of a sweep run in these processes
    attempt = (f"{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
               f"/{init_count()}")
    wd = Watchdog(grid.rank, grid.world_size, address, par.timeout_s, par.heartbeat_s,
                  launcher=grid.launcher, namespace=f"spatialcnn/watchdog/{attempt}").start()
    if grid.rank == 0:
        path = Path(run_dir) / "ranks.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(wd.table(), indent=1), encoding="utf-8")
        log.info("watchdog on: a failed rank stops the job within about %gs (dead peer on this host, or a "
                 "reported error) or %gs (silent peer); ranks' hosts and pids in %s",
                 par.heartbeat_s, par.timeout_s, path)
    return wd


def _fail(exc: BaseException, grid: Grid, watchdog: Watchdog | None) -> NoReturn:
    """Report ``exc`` (once, cleanly) and end this process, or with the watchdog, the job."""
    if isinstance(exc, SystemExit) and not exc.code:
        exc = RuntimeError("exited early (SystemExit)")
    user = isinstance(exc, CLEAN_ERRORS)
    code = EXIT_USER if isinstance(exc, InputError) else EXIT_FAILURE
    collective = bool(getattr(exc, "collective", False))
    if watchdog is not None and collective:
        # Every rank stops here alike: leave together, through the normal exit, so that
        # mpirun reports the status too (a rank that left by os._exit makes it kill the rest).
        watchdog.stop()
        watchdog = None
    if watchdog is None:
        if user:
            if grid.rank == 0 or not collective:  # every rank found the same: one message
                log.error("%s", exc)
        else:
            log.error("failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
        destroy()
        raise SystemExit(code) from exc
    if not user and not watchdog.blames_peer(exc):
        log.error("rank %d: %s: %s", grid.rank, type(exc).__name__, exc, exc_info=exc)
    watchdog.fail(exc, own_error=user, code=code, collective=collective)
