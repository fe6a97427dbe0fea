"""The job pool the numeric launch tests run on (tests/support/jobpool.py) gives each job what a
fresh ``python`` under torchrun would: its variables, argv, working directory and output,
its exit status (a raise, SystemExit, a rank's os._exit, a hang), and never a worker that
a job left inside a process group."""

from __future__ import annotations

import json
from pathlib import Path

from jobpool import JobPool

PROBE = str(Path(__file__).resolve().parents[1] / "support" / "pool_probe.py")


def _reports(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_each_job_sees_its_own_launch(tmp_path):
    pool = JobPool(size=2, warm=())  # nothing to warm: respawns stay cheap
    try:
        one = pool.run(PROBE, ["ok", "a"], nproc=1, cwd=tmp_path, env={"POOL_PROBE": "x", "PATH": "/usr/bin"})
        assert one.returncode == 0, one.stderr
        (r,) = _reports(one.stdout)
        assert r["argv"] == ["ok", "a"] and r["cwd"] == str(tmp_path) and r["env"]["POOL_PROBE"] == "x"
        assert r["env"]["RANK"] is None and r["env"]["MASTER_ADDR"] is None  # plain python: no launcher
        two = pool.run(PROBE, ["ok"], nproc=2, env={"PATH": "/usr/bin"})
        ranks = _reports(two.stdout)
        assert [x["env"]["RANK"] for x in ranks] == ["0", "1"] and {x["env"]["WORLD_SIZE"] for x in ranks} == {"2"}
        assert len({x["env"]["MASTER_PORT"] for x in ranks}) == 1 and ranks[0]["env"]["POOL_PROBE"] is None
        assert pool.run(PROBE, ["exit", "3"], nproc=2, env={}).returncode == 3
        raised = pool.run(PROBE, ["raise"], nproc=1, env={})
        assert raised.returncode == 1 and "ValueError: pool_probe was told to raise" in raised.stderr
        assert pool.started == 1  # the same workers all along
    finally:
        pool.close()


def test_a_dying_or_hanging_job_gets_fresh_workers():
    pool = JobPool(size=2, warm=())  # nothing to warm: respawns stay cheap
    try:
        died = pool.run(PROBE, ["os_exit", "5", "1"], nproc=2, env={}, timeout=60)
        assert died.returncode == 5  # rank 1's own status, the other killed with it
        assert pool.run(PROBE, ["ok"], nproc=2, env={}).returncode == 0 and pool.started == 2
        hung = pool.run(PROBE, ["hang"], nproc=1, env={}, timeout=3)
        assert hung.returncode == 124 and "timed out after 3 s" in hung.stderr
        grouped = pool.run(PROBE, ["process_group"], nproc=2, env={}, timeout=60)
        assert grouped.returncode == 0 and _reports(grouped.stdout)[-1] == {"world": 2}
        assert pool.run(PROBE, ["ok"], nproc=1, env={}).returncode == 0
        assert pool.started == 4  # respawned after the death, the hang and the group left open
    finally:
        pool.close()
