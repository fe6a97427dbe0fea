"""Hydra sweeps (``python -m <model>.train -m KEY=A,B ...``): a run directory per job, a
table of every job, and a failed job that does not stop the rest.

Each job of a sweep trains in ``<sweep dir>/<job number>/`` (its ``run.dir``, unless the
sweep sets ``run.dir`` itself). When a job ends, its rank 0 adds a row (overrides,
status, exit code, final metrics, error) to ``sweep.jsonl`` in the sweep directory and
rewrites ``sweep.csv`` and ``sweep.md`` from it, so the table is complete after every
job, also when a later job is killed. A job that fails records its row and the sweep goes
on; the sweep's exit status is 1 when any job failed (``SweepReport`` tells at the end).

Multi-process jobs: under ``torchrun``/``mpirun`` every rank runs the sweep, the jobs one
after another, each with its own process group (``parallel.runtime.launch.init_count``); a
failure alike on every rank (bad config or data) is recorded and the sweep goes on, but a
rank that crashes ends the sweep. With ``hydra/launcher=spatial_local`` or
``spatial_slurm`` (``hydra-submitit-launcher``) each job starts its own ranks, so a crash
ends only its job; under the local executor ``submitit_env`` sets the rendezvous.
"""

from __future__ import annotations

import csv
import fcntl
import io
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("parallel.sweep")

TABLE = "sweep.jsonl"
COLUMNS = ("job", "status", "exit_code", "overrides", "metric", "best", "steps", "epochs", "time_to_target_s",
           "samples_per_s", "run_seconds", "run_dir", "error")
FAILED: list[int] = []
"""Jobs of this process's sweeps that failed (the entry point's exit status)."""


@dataclass(frozen=True)
class SweepJob:
    """One job of a Hydra sweep, as Hydra describes it."""

    num: int
    overrides: tuple[str, ...]
    sweep_dir: Path
    output_dir: Path


def current_job() -> SweepJob | None:
    """The running job of a sweep, or None for a single run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    return SweepJob(int(hc.job.num), tuple(hc.overrides.task), Path(hc.sweep.dir), Path(hc.runtime.output_dir))


def adopt_run_dir(cfg: Any, job: SweepJob) -> None:
    """Give the job's config its own ``run.dir`` (Hydra's job directory) unless the sweep
    sets ``run.dir``."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in job.overrides}
    if "run.dir" not in keys:
        cfg.run.dir = str(job.output_dir)


def submitit_env() -> None:
    """Under submitit's local executor with several tasks, give each task torchrun's
    variables (rank, world, ``127.0.0.1`` and a port task 0 found free, shared through a
    file in the job's submitit folder). Slurm tasks need nothing: ``parallel.init`` reads
    ``SLURM_*`` (or MPI's variables) and derives the port from the job id."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "local" or "RANK" in os.environ:
        return
    import submitit

    env = submitit.JobEnvironment()
    if env.num_tasks <= 1:
        return
    spot = Path(env.paths.folder) / f"{env.job_id}_rendezvous.txt"
    if env.global_rank == 0:
        from parallel.runtime.launch import free_port

        tmp = spot.with_suffix(".tmp")
        tmp.write_text(str(free_port("127.0.0.1")), encoding="ascii")
        os.replace(tmp, spot)
    deadline = time.monotonic() + 300
    while not spot.is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"task 0 of submitit job {env.job_id} wrote no port to {spot} within 300 s")
        time.sleep(0.05)
    os.environ.update(RANK=str(env.global_rank), WORLD_SIZE=str(env.num_tasks), LOCAL_RANK=str(env.local_rank),
                      LOCAL_WORLD_SIZE=str(env.num_tasks // max(env.num_nodes, 1)), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=spot.read_text(encoding="ascii").strip())


def run_job(fn: Callable[[], dict[str, Any]], job: SweepJob, run_dir: Callable[[], str]) -> dict[str, Any]:
    """Run one job (``fn`` trains it); record its row; never let its failure end the sweep."""
    from parallel.runtime.launch import env_rank

    try:
        summary = fn()
        row = {"status": summary.get("status"), "exit_code": 0, "metric": summary.get("metric"),
               "best": summary.get("best_metric"), "steps": summary.get("steps"),
               "epochs": _round(summary.get("epochs")), "time_to_target_s": _round(summary.get("time_to_target_s")),
               "samples_per_s": _round(summary.get("samples_per_s")), "run_seconds": _round(summary.get("run_seconds")),
               "run_dir": summary.get("run_dir") or run_dir()}
    except SystemExit as exc:  # lifecycle ends a failed job so; its cause is the exception's context
        code = exc.code if isinstance(exc.code, int) else 1
        cause = exc.__cause__ or exc.__context__
        row = {"status": "failed", "exit_code": code, "run_dir": run_dir(),
               "error": (str(cause).splitlines() or [""])[0][:300] if cause is not None else ""}
        FAILED.append(job.num)
        summary = {"status": "failed", "exit_code": code}
    if env_rank() == 0:
        add_row(job.sweep_dir, {"job": job.num, "overrides": " ".join(job.overrides), **row})
    return summary


def _round(v: Any) -> Any:
    return round(v, 4) if isinstance(v, float) else v


def add_row(sweep_dir: Path, row: dict[str, Any]) -> None:
    """Append ``row`` to ``sweep.jsonl`` and rewrite ``sweep.csv`` and ``sweep.md`` (under a
    lock: concurrent jobs of a submitit sweep write at once)."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with open(sweep_dir / ".sweep.lock", "w", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(sweep_dir / TABLE, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        rows = read_rows(sweep_dir)
        _write(sweep_dir / "sweep.csv", _csv(rows))
        _write(sweep_dir / "sweep.md", _markdown(rows))


def read_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """The table's rows, one per job (a job recorded twice: its last row), by job number."""
    by_job: dict[int, dict[str, Any]] = {}
    path = Path(sweep_dir) / TABLE
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
                by_job[int(row["job"])] = row
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a kill
    return [by_job[k] for k in sorted(by_job)]


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _csv(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: "" if r.get(k) is None else r.get(k) for k in COLUMNS})
    return out.getvalue()


def _markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = ["" if r.get(k) is None else str(r.get(k)).replace("|", "\\|") for k in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


try:  # Hydra's callback base (hydra >= 1.1)
    from hydra.experimental.callback import Callback as _Callback
except ImportError:  # pragma: no cover
    _Callback = object  # type: ignore[misc,assignment]


class SweepReport(_Callback):  # type: ignore[misc,valid-type]
    """At the end of a sweep (in the process that ran Hydra): one line naming the table
    and the failed jobs; a failed job makes the sweep's exit status 1."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        from parallel.runtime.launch import env_rank

        sweep_dir = Path(str(config.hydra.sweep.dir))
        rows = read_rows(sweep_dir)
        failed = [r["job"] for r in rows if r.get("status") == "failed"]
        for job in failed:
            if job not in FAILED:
                FAILED.append(job)
        if env_rank() != 0:
            return
        _speak(f"sweep of {len(rows)} job(s) in {sweep_dir} ({socket.gethostname()}): "
               + (f"job(s) {', '.join(map(str, failed))} failed; " if failed else "every job ended; ")
               + f"table in {sweep_dir / 'sweep.md'} (also sweep.csv, sweep.jsonl)")


def _speak(message: str) -> None:
    """Log ``message`` on stderr whether or not a job has set up logging in this process."""
    if not log.handlers and not logging.getLogger("parallel").handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    log.warning("%s", message)
