"""The Slurm path on a real Slurm (tests/support/slurm_cluster.py: slurmctld and two slurmd, nodes
n1 and n2 of 2 CPUs each, on this machine): scripts/submit.sh strong and weak, the Hydra
submitit launcher, the self-check under ``srun --mpi=none`` and ``--mpi=pmi2``, a task
killed mid-run, ``scancel`` mid-run and a resubmission, a job warned before its time limit
that checkpoints, stops and resumes to the weights of an uninterrupted run, and each
finding of the first runs on a real cluster (a repeated job id, staging, cores, GPU flags, node counts, the
rendezvous host). Tiny CosmoFlow sets (16^3) and a few steps; every command has a timeout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mlperf_logs import compliant, mllog
from slurm_cluster import SlurmCluster, alive, slurm  # noqa: F401 - the session fixture
from train_helpers import prepare

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
JOB_TIMEOUT = 300
SYSTEM = f"slurmt{os.getpid()}"  # this session's results and logs under runs/, removed at the end
CONSOLES: list[Path] = []  # the jobs' runs/slurm-<job>_<time>.out, removed at the end


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return prepare("cosmoflow", tmp_path_factory.mktemp("slurm_data") / "cosmo", 16, 8, 4)


@pytest.fixture(scope="module", autouse=True)
def _clean_runs():
    yield
    for p in (ROOT / "runs").glob(f"*{SYSTEM}*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in CONSOLES:
        p.unlink(missing_ok=True)


def _env(slurm: SlurmCluster, tmp: Path, **extra: str) -> dict:
    env = {k: v for k, v in slurm.env.items() if not k.startswith(("OMPI_", "PMI_", "PMIX_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TMPDIR=str(tmp), TIMEOUT="240", SYSTEM=SYSTEM,
               CONFIG_NAME="smoke", RANKS_PER_NODE="2", CORES_PER_NODE="2",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{slurm.env['PATH']}")
    env.update(extra)
    return env


def _submit(slurm: SlurmCluster, env: dict, *args: str, wait: bool = True) -> tuple[subprocess.CompletedProcess, str]:
    """``bash scripts/submit.sh ARGS`` (``-- --wait``: sbatch returns when the job ends); the job id."""
    cmd = ["bash", "scripts/submit.sh", *args]
    if wait:
        cmd += ["--", "--wait"] if "--" not in args else ["--wait"]
    proc = slurm.run(["timeout", str(JOB_TIMEOUT), *cmd], check=False, env=env, cwd=ROOT, timeout=JOB_TIMEOUT + 30)
    m = re.search(r"Submitted batch job (\d+)", proc.stdout)
    return proc, m.group(1) if m else ""


def _console(job: str) -> tuple[Path, str]:
    (path,) = sorted((ROOT / "runs").glob(f"slurm-{job}_*.out"), key=lambda p: p.stat().st_mtime)[-1:]
    CONSOLES.append(path)
    return path, path.read_text(errors="replace")


def _weights(run: Path) -> dict[str, torch.Tensor]:
    ckpt = torch.load(run / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    return ckpt["model"]


def _wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.2)


# -- refused at submission: cheap, no job starts ----------------------------------------------

def test_submission_is_checked_against_the_cluster(slurm, tmp_path):
    """Nodes beyond the partition, more cores than a node has, GPU flags on CPU nodes: refused
    by submit.sh with the numbers (before: pending forever, srun's error, sbatch's gres error);
    an empty SBATCH_EXTRA= / SRUN_EXTRA= clears a config's GPU flags."""
    env = _env(slurm, tmp_path)
    too_many = _submit(slurm, dict(env, NNODES="3"), "--system", "local", "--mode", "strong", "--dry-run",
                       wait=False)[0]
    assert too_many.returncode == 2
    assert "needs 3 node(s)" in too_many.stderr and "partition 'debug' has 2" in too_many.stderr
    cores = _submit(slurm, dict(env, NNODES="1", CORES_PER_NODE="64"), "--system", "local", "--mode", "strong",
                    "--dry-run", wait=False)[0]
    assert cores.returncode == 2 and "CORES_PER_NODE=64" in cores.stderr and "have 2 CPUs" in cores.stderr
    gpu_env = dict(env, NNODES="1", RANKS_PER_NODE="2", CORES_PER_NODE="2", SPATIAL="[2,1,1]")
    gpus = _submit(slurm, gpu_env, "--system", "h200x8", "--dry-run", wait=False)[0]
    assert gpus.returncode == 2 and "--gpus-per-node=8" in gpus.stderr and "have no GPUs" in gpus.stderr
    cleared = _submit(slurm, dict(gpu_env, SBATCH_EXTRA="", SRUN_EXTRA=""), "--system", "h200x8", "--dry-run",
                      wait=False)[0]
    assert cleared.returncode == 0, cleared.stderr
    assert "sbatch -N 1 " in cleared.stdout and "gpus" not in cleared.stdout
    assert "--signal=B:USR1@300" in cleared.stdout  # the cluster configs ask for the time-limit warning
    assert not slurm.run(["squeue", "-h"]).stdout.strip()


def test_cores_beyond_the_node_stop_the_job_before_srun(slurm, data, tmp_path):
    """sbatch of run.sub without submit.sh: run_and_time.sh checks SLURM_CPUS_ON_NODE first."""
    env = _env(slurm, tmp_path, CONFIG="local", MODE="strong", NEXP="1", CORES_PER_NODE="64", DATA_DIR=str(data),
               LOGDIR=str(tmp_path / "logs"), RESULTS_DIR=str(tmp_path / "results"))
    out = tmp_path / "job.out"
    proc = slurm.run(["sbatch", "--wait", "-N", "1", "-t", "2", "-o", str(out), "scripts/run.sub"], check=False,
                     env=env, cwd=ROOT, timeout=JOB_TIMEOUT)
    text = out.read_text()
    assert proc.returncode != 0, text
    assert "RANKS_PER_NODE=2 x 32 thread(s) (CORES_PER_NODE=64) = 64 CPUs per node, but the job has " \
           "SLURM_CPUS_ON_NODE=2 on n1" in text
    assert "More processors requested than permitted" not in text


# -- submissions ---------------------------------------------------------------------------

def test_strong_submission_and_a_repeated_job_id(slurm, data, tmp_path):
    """submit.sh --mode strong through sbatch and srun to a compliant RESULT; then a fresh
    slurmctld gives the next job the same id: its logs, console and staging are its own and
    it never prints or collects the first job's result."""
    stage = tmp_path / "stage"
    results = tmp_path / "results"
    env = _env(slurm, tmp_path, NNODES="1", SPATIAL="[2,1,1]", DATA_DIR=str(data), RESULTS_DIR=str(results),
               STAGE_DIR=str(stage), NEXP="1", SEED="5")
    slurm.restart_controller(clear=True)  # this job is job 1, whatever ran before
    proc, job = _submit(slurm, env, "--system", "local", "--mode", "strong")
    assert job == "1", proc.stdout
    console_path, out = _console(job)
    print(out[-6000:])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (result_line,) = re.findall(r"^RESULT,COSMOFLOW_HPC,,[0-9.]+,spatialcnn,.*$", out, re.M)
    logdir = ROOT / "runs" / f"{SYSTEM}_strong_{job}"
    assert f"logs in {logdir}" in out and "srun --nodes=1 --ntasks=2" in out
    assert re.search(r"INFO placement: 2 ranks on 1 node\(s\).*n1: ranks 0-1", out)
    bench = results / "spatialcnn" / "results" / SYSTEM / "strong" / "cosmoflow"
    assert [p.name for p in bench.glob("result_*.txt")] == ["result_0.txt"] and compliant(bench / "result_0.txt")
    assert "staging_stop" in mllog(logdir / "run_1" / "mlperf.log")
    assert stage.is_dir() and not list(stage.iterdir())  # staged at init, removed at the end of the job
    first_stop = mllog(logdir / "run_1" / "mlperf.log")["run_stop"][0]["time_ms"]

    # A fresh controller state: job ids start again at 1. A stale staging folder of that id stays untouched.
    slurm.restart_controller(clear=True)
    stale = stage / f"spatialcnn_{job}_0_2x1x1"
    stale.mkdir(parents=True)
    (stale / "marker").write_text("an earlier job's")
    # two runs in a row this time (NEXP=2: seeds SEED+1, SEED+2), one step each
    proc2, job2 = _submit(slurm, dict(env, SEED="9", NEXP="2", EXTRA_ARGS="train.max_steps=1 train.stop_at_target=false"),
                          "--system", "local", "--mode", "strong")
    assert job2 == job, (job, job2)
    console2, out2 = _console(job2)
    print(out2[-6000:])
    assert console2 != console_path and console_path.read_text() == out  # the first console is intact
    assert result_line not in out2 and f"belongs to an earlier job with the id {job}" in out2
    logdir2 = Path(re.search(r"logs in (\S+)", out2).group(1))
    assert logdir2 != logdir and logdir2.name.startswith(logdir.name + "_")
    # it trained its own two runs (1 step, no target: aborted), and reported and collected only those
    assert proc2.returncode != 0 and len(re.findall(r"^RESULT,", out2, re.M)) == 2
    assert "mlperf.log was not written by this run" not in out2
    assert [mllog(logdir2 / f"run_{i}" / "mlperf.log")["seed"][0]["value"] for i in (1, 2)] == [10, 11]
    assert sorted(p.name for p in bench.glob("result_*.txt")) == ["result_0.txt", "result_1.txt", "result_2.txt"]
    assert mllog(bench / "result_0.txt")["run_stop"][0]["time_ms"] == first_stop
    assert [mllog(bench / f"result_{i}.txt")["seed"][0]["value"] for i in (1, 2)] == [10, 11]
    assert (stale / "marker").read_text() == "an earlier job's"
    assert [p.name for p in stage.iterdir()] == [stale.name]


def test_run_and_time_never_reports_a_log_it_did_not_write(slurm, data, tmp_path):
    """A run directory holding an earlier run's mlperf.log, which the trainer refuses: no RESULT."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "mlperf.log").write_text(':::MLLOG {"key": "run_start", "time_ms": 1, "value": null}\n'
                                    ':::MLLOG {"key": "run_stop", "time_ms": 2000, "value": null, '
                                    '"metadata": {"status": "success"}}\n')
    (run / "config.yaml").write_text("an earlier run\n")
    env = _env(slurm, tmp_path, DATA_DIR=str(data), LAUNCHER="python", RANKS_PER_NODE="1", SPATIAL="1,1,1")
    proc = subprocess.run(["timeout", "200", str(SCRIPTS / "run_and_time.sh"), "--run-dir", str(run), "--seed", "3"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert proc.returncode != 0 and "RESULT," not in proc.stdout
    assert "mlperf.log was not written by this run" in proc.stderr


@pytest.mark.parametrize("staging", ["once", "each"])
def test_weak_submission_on_two_nodes(slurm, data, tmp_path, staging):
    """Two instances, one per node (srun --relative), staged and cleaned on each node: each
    its own copy (``each``), or (``once``, STAGE_ONCE=1) a staging step of the job reads the
    files once in all, a checked copy on each node, and the instances read nothing."""
    stage = tmp_path / "stage"
    results = tmp_path / "results"
    env = _env(slurm, tmp_path, RANKS_PER_NODE="1", CORES_PER_NODE="1", SPATIAL="[1,1,1]", NODES_PER_INSTANCE="1",
               DATA_DIR=str(data), RESULTS_DIR=str(results), STAGE_DIR=str(stage), SEED="40",
               STAGE_ONCE=str(int(staging == "once")))
    proc, job = _submit(slurm, env, "--system", "local", "--mode", "weak", "--instances", "2")
    _, out = _console(job)
    print(out[-6000:])
    assert proc.returncode == 0 and "sbatch -N 2 " in proc.stdout
    logdir = ROOT / "runs" / f"{SYSTEM}_weak_{job}"
    size, read = sum(p.stat().st_size for p in (data / "train").glob("*.h5")), []  # smoke: val is train/
    for i, node in enumerate(("n1", "n2")):
        console = next(logdir.glob(f"slurm_*_{i}.log")).read_text()
        assert f"--relative={i}" in console and re.search(rf"INFO placement: 1 ranks on 1 node\(s\).*{node}: ranks 0",
                                                         console)
        staged = re.findall(r"all ranks: (\d+) files, [\d.]+ MB; (\d+) bytes read from the source", console)
        read += [int(b) for _, b in staged]  # train and val; once: every file found there and checked
        assert len(staged) == 2 and (staging == "each" or {f for f, _ in staged} == {"0"}), staged
    if staging == "once":  # the step's report: the files read once, a copy written on each node
        (line,) = [x for x in next(logdir.glob("stage_*.log")).read_text().splitlines() if x.startswith("stage: ")]
        report = json.loads(line[len("stage: "):])
        assert report["nodes"] == 2 and report["source_bytes"] == size and report["splits"]["val"]["source_bytes"] == 0
        assert report["splits"]["train"]["bytes_written"] == 2 * size and sum(read) == 0, (report, read)
    else:  # each instance read the set again
        assert all(b > 0 for b in read) and sum(read) >= 2 * size
    found = sorted((results / "spatialcnn" / "results" / SYSTEM / "weak" / "cosmoflow").glob("result_*.txt"))
    assert len(found) == 2 and all(compliant(p) for p in found)
    assert "collect: weak scaling: 2/2 models passed" in out
    assert not list(stage.iterdir())


def test_hydra_submitit_launcher_sweep(slurm, data, tmp_path):
    """hydra/launcher=spatial_slurm: two sbatch jobs, each of 2 srun tasks that meet by themselves."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    env = _env(slurm, tmp_path)
    proc = slurm.run(["timeout", str(JOB_TIMEOUT), sys.executable, "-m", "cosmoflow.train", "-m", "--config-name",
                      "smoke", "train.max_steps=2", "hydra/launcher=spatial_slurm", "hydra.launcher.timeout_min=5",
                      "hydra.launcher.cpus_per_task=1", f"data.dir={data}", f"hydra.sweep.dir={sweep}",
                      "parallel.spatial=[2,1,1]", "optim.lr=0.005,0.01"], check=False, env=env, cwd=ROOT,
                     timeout=JOB_TIMEOUT + 30)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [json.loads(line) for line in (sweep / "sweep.jsonl").read_text().splitlines()]
    assert sorted(r["status"] for r in rows) == ["max_steps", "max_steps"]
    for job in (0, 1):
        summary = json.loads((sweep / str(job) / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["grid"]["spatial"] == [2, 1, 1]
    logs = "".join(p.read_text() for p in (sweep / ".submitit").rglob("*_0_log.err"))
    assert logs.count("(slurm), backend gloo") == 2  # each job's ranks met through SLURM_*


def test_selfcheck_under_srun_mpi_none_and_pmi2(slurm, tmp_path):
    """The self-check on 2 tasks: --mpi=none (SLURM_* rendezvous) and --mpi=pmi2 (mpi4py),
    each on its own node at once."""
    env = _env(slurm, tmp_path)
    procs = {mpi: subprocess.Popen(["timeout", "240", "srun", "-N", "1", "-n", "2", f"--mpi={mpi}",
                                    "--kill-on-bad-exit=1", sys.executable, "-m", "parallel.verify.selfcheck", "--spatial",
                                    "2", "1", "1"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True) for mpi in ("none", "pmi2")}
    outs = {mpi: p.communicate(timeout=260)[0] for mpi, p in procs.items()}
    for mpi, p in procs.items():
        print(mpi, outs[mpi][-3000:])
        assert p.returncode == 0, outs[mpi]
    for mpi, launcher in (("none", "slurm"), ("pmi2", "mpi")):  # pmi2: MPI's world is srun's, so mpi4py
        reports = [json.loads(line) for line in outs[mpi].splitlines() if line.startswith("{")]
        assert reports and all(r["launcher"] == launcher and r["ok"] and r["world_size"] == 2 for r in reports)


def test_unresolvable_rendezvous_host_fails_fast_naming_it(slurm, tmp_path):
    """Nodes n1, n2 do not resolve: without MASTER_ADDR the start stops at once, naming n1."""
    env = _env(slurm, tmp_path)
    env.pop("MASTER_ADDR")
    t0 = time.monotonic()
    proc = slurm.run(["timeout", "120", "srun", "-N", "2", "-n", "2", "--kill-on-bad-exit=1", sys.executable, "-c",
                      "import parallel; parallel.init()"], check=False, env=env, cwd=ROOT, timeout=150)
    assert proc.returncode not in (0, 124), proc.stderr
    assert "the rendezvous host 'n1' (the first node of SLURM_STEP_NODELIST=n[1-2]) does not resolve" in proc.stderr
    assert time.monotonic() - t0 < 60


# -- failures, cancellation, time limits -----------------------------------------------------

LONG = "train.max_steps=100000 train.epochs=100000 train.stop_at_target=false train.eval_every=100000 " \
       "run.log_every=1000"


def test_task_killed_mid_run_is_named_with_its_status(slurm, data, tmp_path):
    logdir = tmp_path / "logs"
    env = _env(slurm, tmp_path, NNODES="1", SPATIAL="[2,1,1]", DATA_DIR=str(data), LOGDIR=str(logdir),
               RESULTS_DIR=str(tmp_path / "results"), NEXP="1", EXTRA_ARGS=LONG)
    proc, job = _submit(slurm, env, "--system", "local", "--mode", "strong", wait=False)
    assert job, proc.stdout + proc.stderr
    ranks = logdir / "run_1" / "ranks.json"
    _wait_for(lambda: ranks.is_file() and slurm.job_state(job) == "RUNNING", 200, "the run's ranks.json")
    time.sleep(2)
    victim = json.loads(ranks.read_text())
    pid = [r["pid"] for r in (victim if isinstance(victim, list) else victim.values())][1]
    os.kill(int(pid), signal.SIGKILL)
    slurm.wait_job(job, 120)
    _, out = _console(job)
    print(out[-5000:])
    assert "task 1 (rank 1) on n1 failed first, exit status 137 (signal 9: KILL); srun returned" in out
    assert "run.sub: run 1 failed (exit 137)" in out


def test_scancel_mid_run_leaves_a_usable_checkpoint_and_a_resubmission_resumes(slurm, data, tmp_path):
    logdir = tmp_path / "logs"
    env = _env(slurm, tmp_path, NNODES="1", SPATIAL="[2,1,1]", DATA_DIR=str(data), LOGDIR=str(logdir),
               RESULTS_DIR=str(tmp_path / "results"), NEXP="1", EXTRA_ARGS=f"{LONG} run.checkpoint_every=1")
    proc, job = _submit(slurm, env, "--system", "local", "--mode", "strong", wait=False)
    ckpt = logdir / "run_1" / "checkpoints" / "last.pt"
    _wait_for(ckpt.is_file, 200, "the first checkpoint")
    time.sleep(1)
    slurm.run(["scancel", job])
    assert slurm.wait_job(job, 60) == "CANCELLED"
    _console(job)
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)  # usable after the kill
    step = int(saved["step"])
    assert step >= 1 and "model" in saved
    target = step + 2
    env2 = dict(env, RESUME="1", EXTRA_ARGS=f"{LONG.replace('train.max_steps=100000', f'train.max_steps={target}')} "
                                            f"run.checkpoint_every=1")
    proc2, job2 = _submit(slurm, env2, "--system", "local", "--mode", "strong")
    _, out2 = _console(job2)
    print(out2[-5000:])
    assert re.search(r"resumed from \S+ at step \d+", out2), out2[-3000:]
    summary = json.loads((logdir / "run_1" / "summary.json").read_text())
    assert f"at step {step} " in out2 or summary["session"]["first_step"] >= step
    assert summary["steps"] == target and summary["session"]["first_step"] >= step


def test_time_limit_warning_checkpoints_and_the_next_submission_resumes_to_the_same_weights(slurm, data,
                                                                                          tmp_path):
    """sbatch -t 1 --signal=B:USR1@60 (TIME_LIMIT_SIGNAL_S=60): Slurm warns the batch shell,
    run.sub passes SIGUSR1 to the tasks, the run checkpoints after its step and stops; a
    resubmission (RESUME=1, same LOGDIR) goes on to step k+3 and ends with the weights of an
    uninterrupted run of k+3 steps."""
    logdir = tmp_path / "logs"
    # one task: the run trains until Slurm's warning comes (its time-limit check runs every 30 s or so)
    env = _env(slurm, tmp_path, NNODES="1", SPATIAL="[1,1,1]", RANKS_PER_NODE="1", CORES_PER_NODE="1",
               DATA_DIR=str(data), LOGDIR=str(logdir), RESULTS_DIR=str(tmp_path / "results"), NEXP="1", SEED="20",
               WALLTIME="1", TIME_LIMIT_SIGNAL_S="60", EXTRA_ARGS=LONG)
    proc, job = _submit(slurm, env, "--system", "local", "--mode", "strong", wait=False)
    assert job, proc.stdout + proc.stderr
    # The run trains until Slurm's warning comes, on Slurm's clock: at the lowest CPU priority
    # it spins only on what the rest of the suite leaves idle (its steps are not what is tested).
    _wait_for(lambda: _renice(job, "cosmoflow.train"), 200, "the job's training process")
    state = slurm.wait_job(job, JOB_TIMEOUT)
    _, out = _console(job)
    print(out[-5000:])
    assert "--signal=B:USR1@60" in proc.stdout
    assert "run.sub: SIGUSR1 (the time limit is near)" in out
    m = re.search(r"run.stop_signal SIGUSR1: stopped after step (\d+) of", out)
    assert m, out[-3000:]
    k = int(m.group(1))
    assert state == "COMPLETED" and "resume with RESUME=1" in out, state
    total = k + 3
    resumed = LONG.replace("train.max_steps=100000", f"train.max_steps={total}")
    env2 = dict(env, RESUME="1", EXTRA_ARGS=resumed, TIME_LIMIT_SIGNAL_S="0", WALLTIME="5")
    # The resubmission and, at once on the other node, the uninterrupted run (same grid, seed, steps).
    ref = tmp_path / "ref"
    env3 = dict(env2, LOGDIR=str(ref), RESUME="0")
    jobs = [_submit(slurm, e, "--system", "local", "--mode", "strong", wait=False)[1] for e in (env2, env3)]
    for j in jobs:
        slurm.wait_job(j, JOB_TIMEOUT)
    _, out2 = _console(jobs[0])
    _console(jobs[1])
    print(out2[-4000:])
    assert f"at step {k} " in out2 and json.loads((logdir / "run_1" / "summary.json").read_text())["steps"] == total
    resumed_w, ref_w = _weights(logdir / "run_1"), _weights(ref / "run_1")
    assert resumed_w.keys() == ref_w.keys()
    for name in ref_w:
        torch.testing.assert_close(resumed_w[name], ref_w[name], rtol=1e-5, atol=1e-6, msg=name)


def _renice(job: str, command: str) -> bool:
    """Every thread of the job's processes running ``command`` (found by their SLURM_JOB_ID)
    to nice 19; whether there was one."""
    found = False
    for proc in Path("/proc").iterdir():
        try:
            if (command.encode() not in (proc / "cmdline").read_bytes()
                    or f"SLURM_JOB_ID={job}".encode() not in (proc / "environ").read_bytes().split(b"\0")):
                continue
            for task in (proc / "task").iterdir():
                os.setpriority(os.PRIO_PROCESS, int(task.name), 19)
            found = True
        except (OSError, ValueError):
            continue
    return found


# -- last: the cluster stops -----------------------------------------------------------------

def test_zz_every_daemon_stops(slurm):
    """Stopping the cluster ends every daemon it started (the fixture checks again at the end)."""
    pids = list(slurm.pids.values())
    assert len(pids) == 3 and all(alive(p) for p in pids)
    slurm.stop()
    assert not [p for p in pids if alive(p)]
    assert not slurm.pids  # the fixture's teardown has nothing left to stop
