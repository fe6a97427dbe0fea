"""Run ``python -m <module> ARGS`` (or ``python script.py ARGS``) jobs on a pool of rank processes that started once.

A training launch costs 4-12 s before any work (a fresh interpreter per rank importing
torch, Hydra and the loop, then the rendezvous); the tests that prove numbers run some
hundred of them for 2-6 steps on 16^3 volumes. The pool's ranks import all of that once
and then run job after job, each with the variables torchrun would give it (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ``LOCAL_RANK``...), its own command
line, working directory and captured output. The job itself is unchanged: the module runs
as ``__main__`` (``runpy``), so the training loop starts and ends its own process group
exactly as under torchrun (``parallel.runtime.launch.init``'s later-job path, the one a sweep
takes), and a job of one rank sees no launcher variables at all, like plain ``python``.

What stays real launches (``tests/support/train_helpers.launch(..., launcher="torchrun")``):
whatever is about the launcher or the process itself: torchrun, mpirun, srun, kills,
exit codes of dying ranks.

Isolation: each job gets the environment it asked for (the worker's own is restored after
it), ``sys.argv``, the working directory, fresh Hydra global state, the ``parallel``
logger's handlers, and file descriptors 1 and 2 redirected to per-rank files (C-level
output included). A job that exits the process (the watchdog's ``os._exit`` after a peer
failed), hangs past its timeout or leaves its rank in a process group makes the pool
kill and respawn every worker, so no job sees another's leftovers.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Mapping, Sequence

import forkstart

REPO = Path(__file__).resolve().parents[2]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
               "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
               "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE", "PMI_RANK", "PMI_SIZE",
               "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
WARM = ("torch", "torch.distributed", "hydra", "omegaconf", "h5py", "cosmoflow.family", "unet3d.family",
        "parallel.train.lifecycle",
        "parallel.train.cli", "parallel.train.loop", "parallel.train.observe.mlperf", "parallel.train.observe.report")


def _worker(rank: int, jobs: Any, results: Any, warm: Sequence[str]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import importlib
    import runpy

    for name in warm:  # what every job would import: paid once per worker
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    base_env = dict(os.environ)
    base_cwd = os.getcwd()
    while True:
        job = jobs.get()
        if job is None:
            os._exit(0)  # nothing left to report; skip the interpreter's slow teardown of torch
        module, argv, env, cwd, out_path, err_path = job
        code: int = 0
        saved_fds = (os.dup(1), os.dup(2))
        out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.environ.clear()
        os.environ.update(env)
        saved_argv, saved_path = sys.argv, list(sys.path)
        sys.argv = [module, *argv]
        # the job's PYTHONPATH, as a fresh interpreter would put it (the worker's came at spawn)
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[1:1] = extra
        try:
            os.chdir(cwd)
            _fresh_state()
            if module.endswith(".py"):  # a script: python path/to/script.py
                sys.path.insert(0, os.path.dirname(os.path.abspath(module)))
                try:
                    runpy.run_path(module, run_name="__main__")
                finally:
                    sys.path.pop(0)
            else:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - what python -m would print, and its status
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.argv = saved_argv
            sys.path[:] = saved_path
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            for fd in (*saved_fds, out, err):
                os.close(fd)
            os.environ.clear()
            os.environ.update(base_env)
            os.chdir(base_cwd)
        # a job that failed half-way may leave its rank in a process group: not reusable
        dist = sys.modules.get("torch.distributed")
        clean = dist is None or not dist.is_initialized()
        results.put((rank, code, clean))
        if not clean:
            return


def _fresh_state() -> None:
    """What one ``python -m`` would start without: Hydra's global state, the loop's logger,
    the peak resident memory, a sweep's list of failed jobs, the count of process groups this process started (a
    fresh process's first group rendezvouses through ``env://``, later ones under a
    prefix: every rank of a job must take the same path)."""
    import logging

    from parallel.runtime import launch

    launch._STARTS[0] = 0
    try:  # the peak resident memory (VmHWM) a job reports is its own, not an earlier job's
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        pass
    sweep = sys.modules.get("parallel.train.cli.sweep")
    if sweep is not None:  # the failed jobs of a sweep this process ran: a fresh process has none
        sweep.FAILED.clear()

    try:
        from hydra.core.global_hydra import GlobalHydra

        GlobalHydra.instance().clear()
    except ImportError:
        pass
    for name in ("parallel", "cosmoflow", "unet3d"):
        logger = logging.getLogger(name)
        for h in list(logger.handlers):
            logger.removeHandler(h)
        logger.propagate = True
        logger.setLevel(logging.NOTSET)


class JobPool:
    """``size`` spawned processes that run ``python -m`` jobs of up to ``size`` ranks;
    ``warm``: the modules each imports once when it starts."""

    def __init__(self, size: int = 4, warm: Sequence[str] = WARM) -> None:
        self.size, self.warm = size, tuple(warm)
        self.procs: list[Any] = []
        self.jobs: list[Any] = []
        self.results: Any = None
        self.started = 0
        self.jobs_run = 0

    def _start(self) -> None:
        ctx = forkstart.context()  # forked from a server that imported WARM once
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(self.size)]
        self.procs = [ctx.Process(target=_worker, args=(r, self.jobs[r], self.results, self.warm),
                                 daemon=True)
                      for r in range(self.size)]
        for p in self.procs:
            p.start()
        self.started += 1

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def run(self, module: str, argv: Sequence[str], nproc: int = 1, env: Mapping[str, str] | None = None,
            cwd: str | Path = REPO, timeout: float = 240.0) -> subprocess.CompletedProcess:
        """``python -m module *argv`` on ``nproc`` ranks (torchrun's variables for more
        than one); the ranks' outputs joined in rank order, like a launcher's."""
        from parallel.runtime.launch import free_port

        if not 1 <= nproc <= self.size:
            raise ValueError(f"a job of {nproc} ranks on a pool of {self.size}")
        if not self.alive:
            self.close()
            self._start()
        base = {k: v for k, v in (env if env is not None else os.environ).items() if k not in LAUNCH_VARS}
        base.setdefault("OMP_NUM_THREADS", "1")
        base["PYTHONPATH"] = str(REPO) + os.pathsep + base.get("PYTHONPATH", "")
        port = str(free_port("127.0.0.1"))
        tmp = Path(tempfile.mkdtemp(prefix="jobpool-"))
        paths = [(tmp / f"out{r}", tmp / f"err{r}") for r in range(nproc)]
        for r in range(nproc):
            e = dict(base)
            if nproc > 1:
                e.update(RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(nproc),
                         GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            self.jobs[r].put((module, list(argv), e, str(cwd), str(paths[r][0]), str(paths[r][1])))
        codes: dict[int, int] = {}  # each rank's own status; ranks the pool had to kill have none
        dirty = False
        deadline = time.monotonic() + timeout
        why = ""
        while len(codes) < nproc:
            try:
                rank, code, clean = self.results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r in range(nproc) if not self.procs[r].is_alive() and r not in codes]
                if dead:
                    # the watchdog's os._exit, or a crash: the others may wait in a collective
                    grace = time.monotonic() + 5.0  # let the peers' own reports or exits land first
                    while len(codes) < nproc and time.monotonic() < grace:
                        for r in range(nproc):
                            if r not in codes and not self.procs[r].is_alive():
                                code = self.procs[r].exitcode
                                codes[r] = code if code is not None and code >= 0 else 128 - (code or 0)
                        try:
                            rank, code, clean = self.results.get(timeout=0.2)
                            codes[rank] = code
                        except queue.Empty:
                            pass
                    dirty = True
                    break
                if time.monotonic() > deadline:
                    why = f"timed out after {timeout:.0f} s"
                    dirty = True
                    break
                continue
            codes[rank] = code
            dirty = dirty or not clean
        if dirty:
            self.close()
        self.jobs_run += 1
        stdout = "".join(_read(o) for o, _ in paths)
        stderr = "".join(_read(e) for _, e in paths) + (f"\njobpool: {why}\n" if why else "")
        for o, e in paths:
            o.unlink(missing_ok=True)
            e.unlink(missing_ok=True)
        tmp.rmdir()
        # a launcher reports a failing rank's own status (the lowest rank's, here)
        rc = next((codes[r] for r in range(nproc) if codes.get(r, 0) != 0), 0)
        if why:
            rc = 124
        elif len(codes) < nproc and rc == 0:
            rc = 1  # ranks left hanging after a peer died: killed with it
        cmd = [sys.executable, module] if module.endswith(".py") else [sys.executable, "-m", module]
        return subprocess.CompletedProcess([*cmd, *argv], rc, stdout, stderr)

    def close(self) -> None:
        for q in self.jobs:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 2.0
        for p in self.procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        self.procs, self.jobs = [], []


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""
