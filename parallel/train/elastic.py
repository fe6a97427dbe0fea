"""Elastic restarts: a job that lost (or regained) ranks goes on by itself.

Under ``torchrun --nnodes=MIN:MAX --max-restarts=K --rdzv-backend=c10d`` the agent
restarts every surviving worker when one fails, with ``TORCHELASTIC_RESTART_COUNT``
raised by one and a world of whatever nodes joined the new rendezvous. At such a restart
the training job fits itself to that world (``docs/failures.md``):

- it resumes from ``run.dir``'s last checkpoint without ``train.resume=true`` (one run
  directory; a restart before any checkpoint starts the run afresh there, the old files
  moved aside as ``train.resume=true`` does);
- the spatial split is kept while it divides the world, else re-chosen as
  ``parallel.spatial=auto`` chooses; the data axis takes the rest;
- the global batch is kept: each rank's micro-batch stays at most that of the run's first
  session (``run.dir/elastic.json``), and gradient accumulation takes up the ranks that
  are missing (global batch 4 on data 2, accumulation 1 -> data 1, accumulation 2);
- the MLPerf log goes on in the same file: the once-per-run keys are not repeated, and an
  ``elastic_restart`` event records each new grid.

What cannot go on (a global batch the data axis does not divide, no split that fits)
stops with exit status 2 and the numbers (``ElasticError``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from parallel.job.errors import InputError
from parallel.train.checks import is_auto

log = logging.getLogger("parallel.train")

RECORD = "elastic.json"
"""The run's elastic record in ``run.dir``: the reference micro-batch and every session's grid."""


class ElasticError(InputError):
    """The job cannot go on in the world it restarted in; the message has the numbers.
    Every rank finds the same (rank 0 decides), so every rank leaves with exit status 2."""


def restart_count(env: dict[str, str] | None = None) -> int:
    """torchrun's restart number of this worker group (0: the first start, or no torchrun)."""
    env = os.environ if env is None else env
    value = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def is_restart(env: dict[str, str] | None = None) -> bool:
    """Whether torchrun's agent restarted this worker group (after a failure or a change of nodes)."""
    return restart_count(env) > 0


def max_restarts(env: dict[str, str] | None = None) -> int:
    """torchrun's ``--max-restarts`` (0 without torchrun): above 0, the job is elastic."""
    env = os.environ if env is None else env
    value = env.get("TORCHELASTIC_MAX_RESTARTS", "0")
    return int(value) if value.isdigit() else 0


def resumes(resume: bool, run_dir: str) -> bool:
    """``train.resume`` as a session takes it: a restart resumes from the last checkpoint in
    ``run_dir`` on its own (with no checkpoint yet the run starts afresh there)."""
    if not is_restart():
        return resume
    if not resume:
        log.info("elastic restart %d: resuming from the last checkpoint in run.dir=%s, if any", restart_count(),
                 run_dir)
    return True


def spatial_choice(spatial: Any, decide: Callable[[Any], Sequence[int]]) -> Any:
    """What ``parallel.init`` gets for ``spatial`` (``parallel.spatial``): at a restart, the
    configured split while it divides the world (rank 0 decides, with the world's
    placement), else the split ``parallel.spatial=auto`` chooses (``decide``). Outside a
    restart: the config's value (``decide`` for ``auto``)."""
    if not is_restart() or is_auto(spatial):
        return decide if is_auto(spatial) else spatial
    fixed = [int(v) for v in spatial]

    def choose(world: Any) -> Sequence[int]:
        size = fixed[0] * fixed[1] * fixed[2]
        if world.world_size % size == 0:
            return fixed
        log.warning("elastic restart: parallel.spatial=%s (%d ranks per sample) does not divide the %d ranks "
                    "left; choosing the split as parallel.spatial=auto does", fixed, size, world.world_size)
        return decide(world)

    return choose


@dataclass
class Session:
    """One session (start or restart) of an elastic run, as ``elastic.json`` keeps it."""

    restart: int
    world_size: int
    data: int
    spatial: list[int]
    accum_steps: int
    micro_batch: int


@dataclass
class Regrid:
    """This session's grid against the run's first, and the accumulation that keeps the global batch."""

    micro_batch: int
    """Samples per rank per micro-step in the run's first session: the most any later one takes."""
    sessions: list[Session] = field(default_factory=list)

    @property
    def current(self) -> Session:
        return self.sessions[-1]

    def event(self, step: int) -> dict[str, Any]:
        """The ``elastic_restart`` MLPerf event's value."""
        cur = self.current
        prev = self.sessions[-2] if len(self.sessions) > 1 else None
        return {"restart": cur.restart, "step": step, "world_size": cur.world_size, "data": cur.data,
                "spatial": cur.spatial, "accum_steps": cur.accum_steps,
                "from": None if prev is None else {"world_size": prev.world_size, "data": prev.data,
                                                    "spatial": prev.spatial, "accum_steps": prev.accum_steps}}


def accumulation(global_batch: int, data: int, accum: int, micro_ref: int | None) -> int:
    """Micro-steps per optimiser step for ``data`` data groups: the configured ``accum``
    while no reference exists (the run's first session), else the fewest micro-steps whose
    micro-batch is at most ``micro_ref`` (the first session's), so the global batch stays
    and no rank holds more samples at once than it did. ``ElasticError`` when the data
    axis does not divide the global batch."""
    if global_batch % data:
        raise ElasticError(f"elastic restart: train.global_batch_size={global_batch} cannot be split over "
                           f"{data} data groups ({global_batch} % {data} = {global_batch % data}); the job "
                           f"cannot keep its global batch with this many ranks")
    if micro_ref is None:
        return accum
    per_rank = global_batch // data
    for a in range(1, per_rank + 1):
        if per_rank % a == 0 and per_rank // a <= micro_ref:
            return a
    return per_rank  # unreachable: a micro-batch of 1 always fits


def regrid(train: Any, run_dir: str, grid: Any) -> Regrid | None:
    """After the process group started and the run directory is settled (every rank): this
    session's grid and the accumulation that keeps ``train.global_batch_size`` in this
    world (``Regrid.current.accum_steps``), recorded in ``run_dir/elastic.json``. Rank 0
    decides and tells the others, so every rank raises the same ``ElasticError``. None
    unless torchrun may restart the job (``--max-restarts`` above 0): nothing to record."""
    if grid.launcher != "torchrun" or not max_restarts():
        return None
    from parallel import comm

    answer: dict[str, Any] = {}
    if grid.rank == 0:
        try:
            answer["regrid"] = asdict(_decide(train, run_dir, grid))
        except ElasticError as err:
            answer["error"] = str(err)
    if grid.world_size > 1:
        raw = comm.all_gather_bytes(json.dumps(answer).encode(), grid.world_group, caller="elastic.regrid")
        answer = json.loads(raw[0].decode())
    if "error" in answer:
        raise ElasticError(answer["error"])
    state = Regrid(answer["regrid"]["micro_batch"], [Session(**s) for s in answer["regrid"]["sessions"]])
    if is_restart():
        cur = state.current
        log.info("elastic restart %d: %d ranks, data %d x spatial %s, accumulation %d (micro-batch %d per rank, "
                 "global batch %d kept)", cur.restart, cur.world_size, cur.data, "x".join(map(str, cur.spatial)),
                 cur.accum_steps, cur.micro_batch, train.global_batch_size)
    return state


def _decide(train: Any, run_dir: str, grid: Any) -> Regrid:
    """Rank 0: this session's accumulation from the record (if any), the record written back."""
    path = Path(run_dir) / RECORD
    known = None
    if is_restart() and path.is_file():
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            known = Regrid(int(raw["micro_batch"]), [Session(**s) for s in raw["sessions"]])
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("elastic restart: %s unreadable (%s); this session's micro-batch becomes the reference",
                        path, err)
    g = train.global_batch_size
    accum = accumulation(g, grid.data_size, train.accum_steps, None if known is None else known.micro_batch)
    micro = max(1, g // (grid.data_size * accum))  # a first session that does not divide: the data module says so
    state = known or Regrid(micro)
    state.sessions.append(Session(restart_count(), grid.world_size, grid.data_size, list(grid.spatial), accum, micro))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{RECORD}.tmp")
    tmp.write_text(json.dumps(asdict(state), indent=1), encoding="utf-8")
    os.replace(tmp, path)
    return state


def continues_log(run: Any, mlperf: Any, resuming: bool) -> bool:
    """Whether this session appends to the run's MLPerf log instead of starting one: an
    elastic restart that resumes a run whose log exists (``run``, ``mlperf``: the job's
    sections)."""
    path = Path(run.dir) / "mlperf.log"
    return is_restart() and resuming and mlperf.enabled and path.is_file() and path.stat().st_size > 0


class ContinuedLog:
    """The MLPerf log of a restarted session: the same file, appended to. The keys a run
    logs once (``init_start`` ... ``run_start``: submission, hyperparameters, staging) are
    dropped, and ``run_start`` becomes an ``elastic_restart`` event with the new grid, so
    the whole log still passes the compliance checker."""

    def __init__(self, log_: Any, regrid_: Regrid | None) -> None:
        self._log, self._regrid = log_, regrid_
        self._running = False

    def _pass(self, key: str) -> bool:
        return self._running

    def run_start(self, step: int) -> None:
        """``run_start`` of a restarted session: an ``elastic_restart`` event with its grid."""
        self._running = True
        value = self._regrid.event(step) if self._regrid is not None else {"restart": restart_count()}
        self._log.event("elastic_restart", value)

    def event(self, key: str, value: Any = None, **metadata: Any) -> None:
        if self._pass(key):
            self._log.event(key, value, **metadata)

    def start(self, key: str, value: Any = None, **metadata: Any) -> None:
        if self._pass(key):
            self._log.start(key, value, **metadata)

    def end(self, key: str, value: Any = None, **metadata: Any) -> None:
        if self._pass(key):
            self._log.end(key, value, **metadata)

    def close(self) -> None:
        self._log.close()


def open_continued_log(run: Any, grid: Any, regrid_: Regrid | None) -> ContinuedLog:
    """The run's ``mlperf.log`` (in ``run.dir``) opened for appending (rank 0; silent
    elsewhere); a line cut by the kill that ended the last session is dropped first, so
    every line parses."""
    from parallel.train.observe.mlperf import MLPerfLog

    path = Path(run.dir) / "mlperf.log"
    if grid.rank == 0:
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(path, "rb+") as fh:
                fh.truncate(data.rfind(b"\n") + 1)
    return ContinuedLog(MLPerfLog(path if grid.rank == 0 else None, True), regrid_)
