"""The process around a training job: start, failure and end.

``train(cfg, family)`` is collective: every rank of the job calls it with the same
config. It validates the config (the first phase of the job's checks,
``parallel.train.checks.JobChecks``), starts the process group (``parallel.spatial=auto``:
rank 0 asks the planner), the watchdog and the threads, runs the ``Trainer`` (which runs
the other phases: samples -> fit -> verify), and ends
the process: 0 after a clean end, 2 for bad input or config, 1 for anything else, after
one clear message; with several ranks the watchdog makes every rank stop, naming the rank
that failed (``docs/failures.md``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch

import parallel
from parallel.data.reader import SampleReadError
from parallel.grid import Grid
from parallel.runtime.launch import RendezvousError, env_rank
from parallel.partition import SplitError
from parallel.job import checkpoint
from parallel.train import elastic
from parallel.train.checks import ConfigError, InputError, JobChecks, is_auto
from parallel.job.config import JobConfig
from parallel.job.family import Family
from parallel.train.loop import Trainer
from parallel.train.observe.report import setup_logging
from parallel.train.checks.budget import start as hold_memory_budget
from parallel.train.step import NonFiniteError
from parallel.runtime.watchdog import Watchdog

log = logging.getLogger("parallel.train")

EXIT_USER = 2
"""Exit status for bad input or config (the message says what to change)."""
EXIT_FAILURE = 1
"""Exit status for anything else."""

# Failures reported as one line (the message says what and where); anything else is
# logged with its traceback, since it is probably a bug.
CLEAN_ERRORS = (InputError, checkpoint.CheckpointError, SampleReadError, SplitError,
                FileNotFoundError, PermissionError, NonFiniteError)


def train(cfg: JobConfig, family: Family, config_text: str | None = None) -> dict[str, Any]:
    """Run a training job from ``cfg``; returns the summary (on every rank).

    Any failure ends the process with a non-zero status (see the module docstring).
    ``config_text``: the resolved config, saved as ``run.dir/config.yaml`` once the run
    directory is settled (``parallel.train.persist.rundir``). A failure alike on every rank (bad
    config or data) ends with ``SystemExit`` on every rank, together, so every launcher
    reports its status (2) and a sweep run in these processes goes on to its next job.
    """
    setup_logging(cfg.run, env_rank())
    checks = JobChecks(cfg, family)  # validate here; the trainer runs samples -> fit -> verify
    auto = is_auto(cfg.parallel.spatial)
    try:
        checks.validate()
    except ConfigError as err:
        if env_rank() == 0:  # every rank finds the same: one message
            log.error("bad config: %s", err)
        raise SystemExit(EXIT_USER) from err
    elastic.prepare(cfg)  # elastic restart (torchrun): resume from run.dir's last checkpoint on its own

    def decide(world: Any) -> list[int]:  # rank 0, once the process group runs; facts are not read again
        from parallel.train.checks.autosplit import auto_spatial

        facts = checks.read_facts()
        return auto_spatial(cfg, family, facts, world_size=world.world_size, local_size=world.max_ranks_per_node)

    try:
        spatial: Any = elastic.spatial_choice(cfg, decide)  # the config's; at a restart, re-chosen if it no longer fits
        grid = parallel.init(spatial, backend=cfg.parallel.backend, timeout_s=cfg.parallel.timeout_s,
                             tf32=cfg.train.tf32)
        if auto:
            log.info("parallel.spatial=auto chose %s for %d ranks (parallel.plan)", "x".join(map(str, grid.spatial)),
                     grid.world_size)
    except RendezvousError as err:  # before any process group: every rank says so and leaves at once
        log.error("%s", err)
        raise SystemExit(EXIT_USER) from err
    except ValueError as err:  # the grid does not fit the world size, or auto found no split
        if env_rank() == 0:  # every rank finds the same: one message
            log.error("bad config: parallel.spatial=%s: %s", "auto" if auto else list(cfg.parallel.spatial), err)
        parallel.destroy()
        raise SystemExit(EXIT_USER) from err
    watchdog = None
    try:
        setup_logging(cfg.run, grid.rank)
        save_config = _settle_run_dir(cfg, grid, config_text)
        regrid = elastic.regrid(cfg, grid)  # torchrun: accumulation for this world, run.dir/elastic.json
        watchdog = _start_watchdog(cfg, grid)
        _set_threads(grid)
        hold_memory_budget(cfg, family, grid, checks.read_facts, watchdog)  # parallel.memory_limit: checked, held
        trainer = Trainer(cfg, family, grid, checks, on_start=save_config, regrid=regrid)
        if watchdog is not None:  # a write in flight ends before a failure ends the process (bounded)
            watchdog.before_exit = lambda: trainer.writer.drain(min(60.0, cfg.parallel.timeout_s))
        summary = trainer.fit()
    except BaseException as exc:  # noqa: BLE001 - every failure ends the job, loudly
        _fail(exc, grid, watchdog)
    if watchdog is not None:
        watchdog.stop()  # before the barrier: nobody watches a peer that has left
    parallel.destroy(cfg.parallel.timeout_s)  # waits for every rank before the group goes
    return summary


def _set_threads(grid: Grid) -> None:
    """CPU ranks share the host's cores unless ``OMP_NUM_THREADS`` says otherwise."""
    if grid.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(grid.local_size, 1)))


def _settle_run_dir(cfg: JobConfig, grid: Grid, config_text: str | None) -> Callable[[], None]:
    """Rank 0 applies the run-directory rule (``rundir.prepare``) before anything is
    written; every rank takes rank 0's ``run.dir`` (a dated one may differ by a second)
    or raises its refusal alike. Returns what saves ``config.yaml`` (rank 0), for the
    trainer to call once a resume is known to proceed."""
    from parallel import comm
    from parallel.train.persist import rundir

    answer: dict[str, str] = {"dir": cfg.run.dir}
    if grid.rank == 0:
        try:
            answer["note"] = rundir.prepare(cfg.run.dir, cfg.train.resume, cfg.run.overwrite)
        except rundir.RunDirError as err:
            answer["error"] = str(err)
    if grid.world_size > 1:
        raw = comm.all_gather_bytes(json.dumps(answer).encode(), grid.world_group, caller="lifecycle.run_dir")
        answer = json.loads(raw[0].decode())
    if "error" in answer:
        raise rundir.RunDirError(answer["error"])
    cfg.run.dir = answer["dir"]
    log.info("%s", answer["note"] if "note" in answer else cfg.run.dir)
    return lambda: _save_config(cfg, grid, config_text)


def _save_config(cfg: JobConfig, grid: Grid, config_text: str | None) -> None:
    """Rank 0 writes ``run.dir/config.yaml``; a resumed run keeps the earlier session's
    as ``config.yaml.<k>`` when the settings differ."""
    if grid.rank == 0 and config_text is not None:
        path = Path(cfg.run.dir) / "config.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        if cfg.train.resume and path.is_file() and path.read_text(encoding="utf-8") != config_text:
            k = 1
            while path.with_name(f"config.yaml.{k}").exists():
                k += 1
            path.rename(path.with_name(f"config.yaml.{k}"))  # the earlier session's settings stay
        path.write_text(config_text, encoding="utf-8")


def _start_watchdog(cfg: JobConfig, grid: Grid) -> Watchdog | None:
    """The watchdog of a multi-rank job; rank 0 writes ``run.dir/ranks.json`` (host, pid)."""
    address = grid.store_address
    if grid.world_size == 1 or address is None:
        return None
    from parallel.runtime.launch import init_count

    # the restart of torchrun's agent, and the job of a sweep run in these processes
    attempt = (f"{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
               f"/{init_count()}")
    wd = Watchdog(grid.rank, grid.world_size, address, cfg.parallel.timeout_s, cfg.parallel.heartbeat_s,
                  launcher=grid.launcher, namespace=f"spatialcnn/watchdog/{attempt}").start()
    if grid.rank == 0:
        path = Path(cfg.run.dir) / "ranks.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(wd.table(), indent=1), encoding="utf-8")
        log.info("watchdog on: a failed rank stops the job within about %gs (dead peer on this host, or a "
                 "reported error) or %gs (silent peer); ranks' hosts and pids in %s",
                 cfg.parallel.heartbeat_s, cfg.parallel.timeout_s, path)
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
        parallel.destroy()
        raise SystemExit(code) from exc
    if not user and not watchdog.blames_peer(exc):
        log.error("rank %d: %s: %s", grid.rank, type(exc).__name__, exc, exc_info=exc)
    watchdog.fail(exc, own_error=user, code=code, collective=collective)
