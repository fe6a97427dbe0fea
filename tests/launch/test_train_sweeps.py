"""Hydra sweeps: every job its own complete run directory, the table of jobs in the sweep
directory, a failed job that does not stop the rest; in one process, with every rank of a
torchrun job running the sweep, and with each job starting its own ranks (submitit's local
executor)."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from train_helpers import BIN, REPO, env, prepare, python_m

SWEEP = ["-m", "--config-name", "smoke", "train.max_steps=2", "run.log_rank=0"]  # Hydra's flags before overrides



@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare("cosmoflow", tmp_path_factory.mktemp("cosmo16"), 16, 8, 4)



def _sweep(cmd: list[str], timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True, timeout=timeout)



def _complete(run: Path, spatial: list[int]) -> dict:
    """A finished run directory: checkpoint, metrics, a closed MLPerf log, the summary."""
    assert (run / "checkpoints" / "last.pt").is_file() and (run / "config.yaml").is_file()
    assert [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()][-1] == 2
    keys = [json.loads(l.split(":::MLLOG ", 1)[1])["key"] for l in (run / "mlperf.log").read_text().splitlines()]
    assert keys.count("run_start") == 1 and keys[-1] == "run_stop"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["grid"]["spatial"] == spatial and summary["run_dir"] == str(run)
    return summary



def _table(sweep: Path) -> list[dict]:
    rows = list(csv.DictReader((sweep / "sweep.csv").open()))
    md = (sweep / "sweep.md").read_text().splitlines()
    assert md[0].startswith("| job | status | exit_code | overrides") and len(md) == 2 + len(rows)
    # one row per job (concurrent jobs append in the order they end; the tables sort them)
    assert sorted(json.loads(l)["job"] for l in (sweep / "sweep.jsonl").read_text().splitlines()) == \
        [int(r["job"]) for r in rows]
    return rows



@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_sweep_gives_each_job_its_run_dir_and_a_table(data, tmp_path, launcher):
    """Four jobs: two train, and between them two whose data.dir is missing (a failure
    alike on every rank: under torchrun, after the watchdog started) that the sweep
    records and goes past."""
    sweep, missing = tmp_path / "sweep", tmp_path / "nowhere"
    grid = [] if launcher == "python" else ["parallel.spatial=[2,1,1]"]
    spatial = [1, 1, 1] if launcher == "python" else [2, 1, 1]
    args = [*SWEEP, f"hydra.sweep.dir={sweep}", *grid, "optim.lr=0.005,0.01", f"data.dir={data},{missing}"]
    if launcher == "python":  # one process: the session's job pool runs it as python -m would
        proc = python_m("cosmoflow.train", args, timeout=400)
    else:
        proc = _sweep([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "-m", "cosmoflow.train", *args])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]  # a job failed: the sweep says so in its status
    jobs = {0: "0.005", 2: "0.01"}
    for job, lr in jobs.items():
        _complete(sweep / str(job), spatial)
        assert (sweep / str(job) / "config.yaml").read_text().split("\n  lr: ", 1)[1].split("\n")[0] == lr
    rows = _table(sweep)
    assert [r["job"] for r in rows] == ["0", "1", "2", "3"]
    for r in rows:
        if int(r["job"]) in jobs:
            assert r["status"] == "max_steps" and r["exit_code"] == "0" and r["metric"] == "val_mae"
            assert float(r["best"]) > 0 and f"optim.lr={jobs[int(r['job'])]}" in r["overrides"]
            assert r["run_dir"] == str(sweep / r["job"])
        else:
            assert r["status"] == "failed" and r["exit_code"] == "2" and f"data.dir={missing}" in r["overrides"]
            assert "does not exist; generate a set with" in r["error"]
            assert not (sweep / r["job"] / "checkpoints").exists()
    # every rank runs the sweep; rank 0 alone writes the rows and speaks, once per failure
    assert out.count(f"job(s) 1, 3 failed; table in {sweep / 'sweep.md'}") == 1
    assert out.count(f"data.dir: {missing} does not exist") == 2



@pytest.mark.parametrize("launcher", ["spatial_local"])
def test_submitit_launcher_starts_each_jobs_ranks(data, tmp_path, launcher):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    proc = _sweep([sys.executable, "-m", "cosmoflow.train", *SWEEP, f"hydra/launcher={launcher}",
                   f"data.dir={data}", f"hydra.sweep.dir={sweep}", "parallel.spatial=[2,1,1]", "optim.lr=0.005,0.01"])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for job in (0, 1):
        _complete(sweep / str(job), [2, 1, 1])
    assert [r["status"] for r in _table(sweep)] == ["max_steps", "max_steps"]
    # two submitit jobs, each of two tasks (its ranks) that met through the port task 0 wrote
    jobs = [p for p in (sweep / ".submitit").iterdir() if p.name.isdigit()]
    assert len(jobs) == 2
    for job in jobs:
        assert (job / f"{job.name}_rendezvous.txt").read_text().isdigit()
        assert (job / f"{job.name}_0_log.err").is_file() and (job / f"{job.name}_1_log.err").is_file()
