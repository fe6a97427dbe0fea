"""Jobs across hosts with their own addresses, and links that fail under them.

The hosts are network namespaces on a bridge (``tests/support/netns_hosts.py``: each its
own address, 10.77.0.x, and hostname, ``host1``...). A torchrun job with a c10d
rendezvous on host1's address runs one rank per host, its spatial group (2x1x1) split
across the link, so every halo exchange and gradient all-reduce crosses it.

- The link of host2 taken down mid-run (a pulled cable: nothing is told, packets vanish):
  host1's rank names rank 1 on host2 as silent, host2's rank names the store on host1 it
  lost, both launchers end within the timeout, no process is left on either host, and the
  last checkpoint is intact. TCP on the hosts gives up on an unanswered peer after a few
  retransmissions (``net.ipv4.tcp_retries2=5``, set per host): torchrun's agent on the
  cut-off host otherwise waits in a store call until TCP's default (about 15 minutes).
- A slow and lossy link (host2 sends at 1 Mbit/s, ``tc tbf``, and what overflows 50 ms of
  queue is dropped and retransmitted; this machine's kernel has no ``tc netem``): the job
  finishes with the weights of the same job on one host, bit for bit, and its step-time
  breakdown puts the time lost in the communication.
- an elastic job on three hosts whose third is cut off (nightly): the survivors restart
  without it (data 3 -> 2, accumulation 2), resume from the last checkpoint and finish.
- mpirun across the hosts (nightly): hydra reaches each host through an ssh stand-in
  (``netns_hosts.ssh_standin``), the job ends with the one-host weights bit for bit, and
  a cut link ends it naming rank 1 on host2, nothing left behind (the stand-in keeps each
  host's proxy a child of mpirun on this machine, so mpirun's cleanup reaches it; with a
  real ssh the cut-off host's proxy would wait for its own connection to fail).
- srun across the hosts (nightly): the real Slurm with node n1 on host1 and n2 on host2
  (``tests/support/netns_slurm.py``); the same weights as on one host, and a cut link ends
  the step (rank 0 names rank 1 on host2 within the timeout; Slurm itself reports ``Node
  failure on n2``), no training process left.

Root only (network namespaces): without them the tests skip saying why, and fail in CI
(``CI=true``), as the real-Slurm tests do.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import netns_hosts
from parallel.job import checkpoint
from train_helpers import REPO, env, launch, prepare, weights

TIMEOUT_S = 10  # parallel.timeout_s: a silent peer is declared dead after this
TINY = ["--config-name", "quickstart", "train.global_batch_size=4", "model.conv_filters=4", "model.n_conv_blocks=2",
        "model.dense_sizes=[16]", "model.input_shift=3.8", "model.input_scale=2.0", "optim.lr=0.02",
        "model.dropout=0.0", "run.progress=false", "run.tensorboard=false", "train.eval_every=0",
        "train.eval_at_end=false", "data.workers=0", "mlperf.enabled=false", "parallel.spatial=[2,1,1]",
        "run.log_rank=-1", f"parallel.timeout_s={TIMEOUT_S}", "run.checkpoint_every=2"]

@pytest.fixture(scope="module")
def data(tmp_path_factory):
    # as the real-Slurm tests: without network namespaces (not root) skip, saying why; in CI fail
    why = netns_hosts.available()
    if why is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must run the namespace-host tests, but: {why}")
        pytest.skip(f"no network namespaces here: {why}")
    return prepare("cosmoflow", tmp_path_factory.mktemp("cosmo16"), 16, 16, 4)  # test_fail_checkpoint's set



def _start(hs, args, logs: Path) -> list[subprocess.Popen]:
    """torchrun on every host, one rank each, the rendezvous on host1's address."""
    procs = []
    for i, h in enumerate(hs):
        e = env()
        e["GLOO_SOCKET_IFNAME"] = h.dev  # gloo's connections on the host's own link
        cmd = [str(Path(sys.executable).parent / "torchrun"), f"--nnodes={len(hs)}", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={hs[0].addr}:29400", "--rdzv-id=netns",
               f"--local-addr={h.addr}", "--max-restarts=0", "--rdzv-conf=read_timeout=10",
               "-m", "cosmoflow.train", *args]
        out = open(logs / f"{h.name}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append(h.popen(cmd, env=e, cwd=REPO, stdout=out, stderr=subprocess.STDOUT))
    return procs



def _wait(procs, timeout_s: float) -> list[int | None]:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    return [p.poll() for p in procs]



def test_a_link_taken_down_mid_run_ends_the_job_naming_the_host(data, tmp_path):
    run = tmp_path / "run"
    with netns_hosts.hosts(2) as hs:
        for h in hs:
            h.sysctl("net.ipv4.tcp_retries2", "5")
        procs = _start(hs, [*TINY, f"data.dir={data}", "train.max_steps=400", f"run.dir={run}"], tmp_path)
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "last.pt").exists() and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), "a launcher ended before the link went down"
            time.sleep(0.2)
        hs[1].link_down()
        cut = time.monotonic()
        codes = _wait(procs, 6 * TIMEOUT_S)
        ended_s = time.monotonic() - cut
        left = {h.name: h.pids() for h in hs}
    logs = {h.name: (tmp_path / f"{h.name}.log").read_text(errors="replace") for h in hs}
    assert codes == [1, 1], (codes, logs["host1"][-3000:], logs["host2"][-3000:])
    assert left == {"host1": [], "host2": []}, f"processes left {ended_s:.0f} s after the cut: {left}"
    table = json.loads((run / "ranks.json").read_text())
    assert [(r["rank"], r["host"]) for r in table] == [(0, "host1"), (1, "host2")]
    pid1 = table[1]["pid"]
    assert f"rank 0: stopping: rank 1 (process {pid1} on host2) sent no heartbeat for" in logs["host1"], \
        logs["host1"][-3000:]
    assert f"rank 1: stopping: lost the job's store at {hs[0].addr}:" in logs["host2"], logs["host2"][-3000:]
    ckpt = checkpoint.load(run / "checkpoints" / "last.pt")  # the last one whole, from agreeing replicas
    assert ckpt["step"] >= 2 and ckpt["replicas"]["agree"] is True



def test_a_slow_lossy_link_changes_no_weight_and_shows_in_the_step_times(data, tmp_path):
    args = [*TINY, f"data.dir={data}", "train.max_steps=6"]
    with netns_hosts.hosts(2) as hs:
        hs[1].slow("1mbit", queue="50ms")
        procs = _start(hs, [*args, f"run.dir={tmp_path / 'slow'}"], tmp_path)
        codes = _wait(procs, 240)
    assert codes == [0, 0], [(tmp_path / f"{h}.log").read_text(errors="replace")[-2000:] for h in ("host1", "host2")]
    launch("cosmoflow", 2, [*args, f"run.dir={tmp_path / 'local'}"], timeout=120)
    a, b = weights(tmp_path / "slow"), weights(tmp_path / "local")
    assert all(torch.equal(a[k], b[k]) for k in a), "the slow link changed the weights"
    slow = json.loads((tmp_path / "slow" / "summary.json").read_text())["step_time"]["mean"]
    local = json.loads((tmp_path / "local" / "summary.json").read_text())["step_time"]["mean"]
    waited = slow["halo_exchange_s"] + slow["grad_allreduce_s"] - local["halo_exchange_s"] - local["grad_allreduce_s"]
    # host2's share of a step's messages (halos, the gradients' all-reduce: tens of kB) at 1 Mbit/s
    assert waited > 0.05 and waited > 0.5 * (slow["step_s"] - local["step_s"]), (slow, local)



def test_mpirun_across_hosts_equals_one_host_and_a_cut_link_ends_it(data, tmp_path):
    # hydra's proxies reach the hosts through netns_hosts.ssh_standin (-launcher ssh -launcher-exec);
    # the ranks' MPI (mpi4py's rendezvous) and gloo cross the bridge
    def mpirun(hs, args):
        ssh = netns_hosts.ssh_standin(hs, str(tmp_path))
        cmd = [str(Path(sys.executable).parent / "mpirun"), "-launcher", "ssh", "-launcher-exec", ssh,
               "-localhost", hs[0].name, "-hosts", ",".join(h.name for h in hs), "-n", str(len(hs)), "-ppn", "1",
               "-genv", "GLOO_SOCKET_IFNAME", "eth0", sys.executable, "-m", "cosmoflow.train", *args]
        return hs[0].popen(cmd, env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    args = [*TINY, f"data.dir={data}"]
    with netns_hosts.hosts(2) as hs:
        out, _ = mpirun(hs, [*args, "train.max_steps=4", f"run.dir={tmp_path / 'mpi'}"]).communicate(timeout=180)
        for h in hs:
            h.sysctl("net.ipv4.tcp_retries2", "5")
        run = tmp_path / "cut"
        proc = mpirun(hs, [*args, "train.max_steps=400", f"run.dir={run}"])
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "last.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        hs[1].link_down()
        cut_out, _ = proc.communicate(timeout=6 * TIMEOUT_S)
        time.sleep(2)  # the node monitor's last look
        left = {h.name: h.pids() for h in hs}
    table = json.loads((tmp_path / "mpi" / "ranks.json").read_text())
    assert [(r["rank"], r["host"]) for r in table] == [(0, "host1"), (1, "host2")], out[-3000:]
    launch("cosmoflow", 2, [*args, "train.max_steps=4", f"run.dir={tmp_path / 'local'}"], timeout=120)
    a, b = weights(tmp_path / "mpi"), weights(tmp_path / "local")
    assert all(torch.equal(a[k], b[k]) for k in a), "mpirun across hosts changed the weights"
    assert proc.returncode != 0 and left == {"host1": [], "host2": []}, (proc.returncode, left, cut_out[-3000:])
    pid1 = json.loads((run / "ranks.json").read_text())[1]["pid"]
    assert f"rank 0: stopping: rank 1 (process {pid1} on host2) sent no heartbeat for" in cut_out, cut_out[-3000:]



def test_elastic_survivors_go_on_after_a_link_is_cut(data, tmp_path):
    # three hosts, data 3; host3's link cut: host1 and host2 restart without it (data 2,
    # accumulation 2 keeps the global batch of 12), resume from the last checkpoint, finish.
    # parallel.timeout_s=30: a restarted worker may start 10-20 s after its peer on this machine.
    run = tmp_path / "run"
    args = [a for a in TINY if not a.startswith(("parallel.spatial", "parallel.timeout_s"))]
    args += ["parallel.spatial=[1,1,1]", "parallel.timeout_s=30", "train.global_batch_size=12", "train.epochs=100",
             "train.max_steps=40", f"data.dir={data}", f"run.dir={run}"]
    with netns_hosts.hosts(3) as hs:
        for h in hs:
            h.sysctl("net.ipv4.tcp_retries2", "5")
        procs = []
        for h in hs:
            e = env()
            e["GLOO_SOCKET_IFNAME"] = h.dev
            cmd = [str(Path(sys.executable).parent / "torchrun"), "--nnodes=2:3", "--nproc-per-node=1",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint={hs[0].addr}:29400", "--rdzv-id=elastic",
                   f"--local-addr={h.addr}", "--max-restarts=2", "--rdzv-conf=read_timeout=10,last_call_timeout=5",
                   "-m", "cosmoflow.train", *args]
            out = open(tmp_path / f"{h.name}.log", "w")  # noqa: SIM115 - closed with the process
            procs.append(h.popen(cmd, env=e, cwd=REPO, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "last.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        hs[2].link_down()
        codes = _wait(procs, 240)
        left = {h.name: h.pids() for h in hs}
    logs = {h: (tmp_path / f"{h}.log").read_text(errors="replace") for h in ("host1", "host2", "host3")}
    assert codes[:2] == [0, 0] and codes[2] not in (0, None), (codes, logs["host1"][-3000:])
    assert left == {"host1": [], "host2": [], "host3": []}, left
    sessions = json.loads((run / "elastic.json").read_text())["sessions"]
    assert [(s["world_size"], s["data"], s["accum_steps"]) for s in sessions] == [(3, 3, 1), (2, 2, 2)], sessions
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "max_steps" and summary["steps"] == 40 and summary["session"]["first_step"] > 0



def _training(hs) -> list[tuple[str, int]]:
    """The training processes still running on the hosts (the Slurm daemons aside)."""
    found = []
    for h in hs:
        for pid in h.pids():
            try:
                if "cosmoflow.train" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                    found.append((h.name, pid))
            except OSError:
                pass
    return found



def test_srun_across_hosts_equals_one_host_and_a_cut_link_ends_it(data, tmp_path):
    # the real Slurm (tests/support/slurm_cluster.py) with node n1 on host1 and n2 on host2
    # (NodeAddr: the hosts' addresses); srun runs on host1, one task per node
    import netns_slurm

    args = [*TINY, f"data.dir={data}"]
    srun = ["srun", "-N", "2", "-n", "2", "--ntasks-per-node=1", sys.executable, "-m", "cosmoflow.train", *args]
    with netns_hosts.hosts(2) as hs:
        for h in hs:
            h.sysctl("net.ipv4.tcp_retries2", "5")
        cluster = netns_slurm.HostsSlurm(tmp_path / "slurm", hs).start()
        try:
            e = dict(cluster.env, **{k: v for k, v in env().items() if k in ("PYTHONPATH", "OMP_NUM_THREADS")})
            whole = cluster.run([*srun, "train.max_steps=4", f"run.dir={tmp_path / 'srun'}"], env=e, cwd=REPO,
                                timeout=180)
            run = tmp_path / "cut"
            proc = subprocess.Popen(hs[0].command([*srun, "train.max_steps=400", f"run.dir={run}"]), env=e, cwd=REPO,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
            deadline = time.monotonic() + 120
            while not (run / "checkpoints" / "last.pt").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            hs[1].link_down()
            cut_out, _ = proc.communicate(timeout=180)  # Slurm's own node-failure detection: about 80 s here
            deadline = time.monotonic() + 60
            while _training(hs) and time.monotonic() < deadline:
                time.sleep(0.5)
            left = _training(hs)
        finally:
            cluster.stop()
    table = json.loads((tmp_path / "srun" / "ranks.json").read_text())
    assert [(r["rank"], r["host"]) for r in table] == [(0, "host1"), (1, "host2")], whole.stdout[-3000:]
    launch("cosmoflow", 2, [*args, "train.max_steps=4", f"run.dir={tmp_path / 'local'}"], timeout=120)
    a, b = weights(tmp_path / "srun"), weights(tmp_path / "local")
    assert all(torch.equal(a[k], b[k]) for k in a), "srun across hosts changed the weights"
    assert proc.returncode != 0 and not left, (proc.returncode, left, cut_out[-3000:])
    pid1 = json.loads((run / "ranks.json").read_text())[1]["pid"]
    assert f"rank 0: stopping: rank 1 (process {pid1} on host2) sent no heartbeat for" in cut_out, cut_out[-3000:]
    assert "Node failure on n2" in cut_out, cut_out[-3000:]
