"""The prepared GPU check behind ``scripts/gpu_check.sh``: everything a GPU machine must
show once, in a few minutes, with one summary.

Steps (each a separate process, as a user would run it):

1. ``selfcheck``: the split model against its serial twin on one GPU in every precision
   (fp32, tf32, bf16, fp16), then over all GPUs with NCCL (fp32, bf16);
2. ``layers``: every split layer's equivalence test, the halo and adjoint tests on the
   GPUs (``SPATIALCNN_TEST_DEVICE=cuda``; needs two GPUs or more);
3. ``train``: a short CosmoFlow and U-Net training on the GPUs in bf16 and fp16, a
   resume that continues it, and a prediction from its checkpoint; the bf16 training
   again with ``parallel.channels_last=true`` (samples/s beside the default's);
4. ``probe``: step time and peak memory of a CosmoFlow step per GPU: allocated, reserved,
   and the device memory in use (``mem_get_info``: reserved + CUDA context + NCCL);
5. ``bench``: ``scripts/benchmark.py step --device cuda`` on two GPUs (skipped by ``--cpu``).

A step that outlasts its timeout ends with its whole process tree (``end_tree``: torchrun's
workers run in sessions of their own and would otherwise hold the GPUs).

``--cpu`` runs the same steps on the CPU with gloo at tiny sizes (2 ranks, bf16 where a
precision is asked for; fp16 and tf32 need a GPU), so the check itself is tested where
no GPU is. Writes ``OUT/gpu_check.json`` and prints a table; exits 1 if a step failed.

    bash scripts/gpu_check.sh                 # on a GPU machine
    bash scripts/gpu_check.sh --cpu           # the dry run (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SPLITS = {1: (1, 1, 1), 2: (2, 1, 1), 3: (3, 1, 1), 4: (2, 2, 1), 6: (3, 2, 1), 8: (2, 2, 2)}
CPU_LAYER_CASES = [  # a few cases on 2 ranks: the dry run checks the plumbing, the full suite the rest
    "tests/ranks/test_layers.py::test_conv3d[k3-pad1-D2]", "tests/ranks/test_layers.py::test_norm[batchnorm-D2]",
    "tests/ranks/test_comm_adjoint.py::test_adjoints[spatial2]",
]
GPU_LAYER_FILES = ["tests/ranks/test_layers.py", "tests/ranks/test_halo.py", "tests/ranks/test_conv_paths.py",
                   "tests/ranks/test_comm_adjoint.py", "tests/ranks/test_channels_last.py"]


@dataclass
class Result:
    step: str
    status: str = "pass"  # pass, fail, skip
    seconds: float = 0.0
    notes: str = ""
    data: dict[str, Any] = field(default_factory=dict)


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.cpu = args.cpu
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.gpus = 0 if self.cpu else _gpu_count()
        self.ranks = 2 if self.cpu else self.gpus
        self.split = SPLITS.get(self.ranks, (self.ranks, 1, 1))
        self.results: list[Result] = []
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            self.env.pop(var, None)
        if self.cpu:
            self.env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")

    # -- running ---------------------------------------------------------------------
    def run(self, step: str, cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> Result:
        """Run ``cmd``; its output goes to ``OUT/logs/<step>.log``."""
        log = self.out / "logs" / f"{step.replace(' ', '_')}.log"
        log.parent.mkdir(exist_ok=True)
        t0 = time.perf_counter()
        # its own session: on a timeout the whole tree ends, torchrun's workers included
        proc = subprocess.Popen(cmd, cwd=REPO, env=env or self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            text, code = out + err, proc.returncode
        except subprocess.TimeoutExpired:
            ended = end_tree(proc.pid)
            out, err = proc.communicate()
            text, code = f"{out}{err}\ntimed out after {timeout:.0f} s; ended processes {ended}", 124
        log.write_text(f"$ {' '.join(cmd)}\n{text}", encoding="utf-8")
        result = Result(step, "pass" if code == 0 else "fail", round(time.perf_counter() - t0, 1))
        result.data["output"] = text
        if code != 0:
            result.notes = f"exit {code}, see {log.relative_to(self.out)}"
        return result

    def record(self, result: Result) -> Result:
        result.data.pop("output", None)
        self.results.append(result)
        print(f"gpu_check: {result.step}: {result.status} ({result.seconds:.1f} s) {result.notes}", flush=True)
        return result

    def launcher(self, n: int) -> list[str]:
        if n == 1:
            return [sys.executable]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]

    # -- the steps -------------------------------------------------------------------
    def selfchecks(self) -> None:
        # the CPU dry run: bf16, the precision a GPU trains in (float32 at one rank and at several
        # is what `python -m parallel.selfcheck` and every launcher's test run on the CPU already)
        for precision in (("bf16",) if self.cpu else ("fp32", "tf32", "bf16", "fp16")):
            self._selfcheck(1, precision)
        if self.ranks > 1:
            for precision in (("bf16",) if self.cpu else ("fp32", "bf16")):
                self._selfcheck(self.ranks, precision)

    def _selfcheck(self, n: int, precision: str) -> None:
        backend = "gloo" if self.cpu else ("nccl" if n > 1 else "cuda")
        spatial = SPLITS.get(n, (n, 1, 1))
        r = self.run(f"selfcheck {n} rank(s) {backend} {precision}",
                     [*self.launcher(n), "-m", "parallel.verify.selfcheck", "--spatial", *map(str, spatial),
                      "--batch", "4",
                      "--precision", precision], timeout=300)
        report = _last_json(r.data["output"])
        if report:
            r.data.update({k: report.get(k) for k in ("max_rel_diff", "worst", "tolerance", "device", "checksums")})
            r.notes = r.notes or (f"max rel diff {report['max_rel_diff']:.1e} <= {report['tolerance']:g} "
                                  f"({report['worst']})")
            if not self.cpu and report.get("device", "").startswith("cpu"):
                r.status, r.notes = "fail", "ran on the CPU, not a GPU"
        self.record(r)

    def layers(self) -> None:
        pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"]
        if self.cpu:
            self.record(self.run("layer tests (2 gloo ranks, a few cases)", [*pytest, *CPU_LAYER_CASES], 600))
        elif self.gpus < 2:
            self.record(Result("layer tests on GPUs", "skip", notes="needs 2 GPUs or more"))
        else:
            env = dict(self.env, SPATIALCNN_TEST_DEVICE="cuda")
            r = self.run(f"layer tests on {self.gpus} GPUs (nccl)", [*pytest, *GPU_LAYER_FILES], 900, env)
            r.notes = r.notes or _last_line(r.data["output"])
            self.record(r)

    def train(self, model: str) -> None:
        size = 16 if self.cpu else 64
        data = self.out / f"data_{model}"
        if not (data / "val" / "manifest.json").exists():
            n_train, n_val = (8, 4) if model == "cosmoflow" else (4, 2)
            r = self.run(f"prepare {model}", [sys.executable, "-m", f"{model}.prepare", "synthetic", "--out",
                                              str(data), "--size", str(size), "--train", str(n_train),
                                              "--val", str(n_val), "--seed", "0", "--quiet", "--workers", "1"], 300)
            if r.status != "pass":
                self.record(r)
                return
        for precision in (("bf16",) if self.cpu else ("bf16", "fp16")):
            run_dir = self.out / f"run_{model}_{precision}"
            common = ["--config-name", "smoke", f"data.dir={data}", f"run.dir={run_dir}",
                      f"train.precision={precision}",
                      f"parallel.spatial=[{','.join(map(str, self.split))}]", "train.eval_every=0",
                      "run.progress=false", "run.tensorboard=false", "mlperf.enabled=false",
                      f"train.global_batch_size={2 if model == 'unet3d' else 4}"]
            cmd = [*self.launcher(self.ranks), "-m", f"{model}.train", *common]
            first = self.run(f"train {model} {precision}", [*cmd, "train.max_steps=2", "train.eval_at_end=false",
                                                                 "run.overwrite=true"], 600)  # a rerun of the check
            first.data["summary"] = _summary(run_dir)
            self.record(_with_summary(first))
            if first.status != "pass":
                continue
            if precision == "bf16":  # cuDNN's bf16 convolutions prefer NDHWC: the same run laid out so
                cl_dir = self.out / f"run_{model}_{precision}_channels_last"
                cl = self.run(f"train {model} {precision} channels-last",
                              [*self.launcher(self.ranks), "-m", f"{model}.train",
                               *(c for c in common if not c.startswith("run.dir=")), f"run.dir={cl_dir}",
                               "parallel.channels_last=true", "train.max_steps=2",
                               "train.eval_at_end=false", "run.overwrite=true"], 600)
                cl.data["summary"] = _summary(cl_dir)
                self.record(_with_summary(cl))
            again = self.run(f"resume {model} {precision}", [*cmd, "train.max_steps=4", "train.resume=true"], 600)
            summary = _summary(run_dir)
            if again.status == "pass" and ("resumed from" not in again.data["output"] or summary.get("steps") != 4):
                again.status, again.notes = "fail", f"did not resume to step 4 (summary steps {summary.get('steps')})"
            again.data["summary"] = summary
            self.record(_with_summary(again))
            out = self.out / f"predict_{model}_{precision}" / ("predictions.csv" if model == "cosmoflow" else "")
            self.record(self.run(f"predict {model} {precision}",
                                 [*self.launcher(self.ranks), "-m", f"{model}.predict", "--run-dir", str(run_dir),
                                  "--data", str(data / "val"), "--out", str(out), "--spatial",
                                  *map(str, self.split)], 300))

    def probe(self) -> None:
        for n in ([self.ranks] if self.cpu else sorted({1, self.ranks})):
            size = 16 if self.cpu else 128
            r = self.run(f"probe cosmoflow {size}^3 {n} rank(s)",
                         [*self.launcher(n), str(REPO / "scripts" / "gpu_probe.py"), "--size", str(size),
                          "--spatial", *map(str, SPLITS.get(n, (n, 1, 1))),
                          "--precision", "bf16" if not self.cpu else "fp32"], 600)
            rows = [_json(line[6:]) for line in r.data["output"].splitlines() if line.startswith("PROBE ")]
            rows = [row for row in rows if row]
            if rows:
                r.data["ranks"] = rows
                used = max(row["device_used_bytes"] for row in rows) / 2**20
                reserved = max(row["reserved_bytes"] for row in rows) / 2**20
                r.notes = r.notes or (f"step {rows[0]['step_seconds'] * 1e3:.1f} ms, peak {used:.0f} MiB per rank "
                                      f"(device in use), reserved {reserved:.0f} MiB")
            elif r.status == "pass":
                r.status, r.notes = "fail", "no PROBE lines in the output"
            self.record(r)

    def bench(self) -> None:
        """``scripts/benchmark.py step --device cuda``: serial, spatial 2 and data 2 on two GPUs
        (its trial times reduced and its grids built on the GPUs, not the CPU)."""
        if self.cpu:  # GPUs only: tests/unit/test_device_paths.py checks where its tensors go
            return
        if self.gpus < 2:
            self.record(Result("benchmark step --device cuda", "skip", notes="needs 2 GPUs or more"))
            return
        r = self.run("benchmark step --device cuda",
                     [sys.executable, str(REPO / "scripts" / "benchmark.py"), "step", "--device", "cuda",
                      "--models", "cosmoflow", "--size", "64", "--batch", "2", "--trials", "3", "--no-weak",
                      "--calibration", str(self.out / "calibration.json"), "--out", str(self.out / "bench_step.jsonl")], 900)
        r.notes = r.notes or _last_line(r.data["output"])
        self.record(r)

    # -- summary ---------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        failed = [r.step for r in self.results if r.status == "fail"]
        report = {"ok": not failed, "failed": failed, "mode": "cpu dry run" if self.cpu else "gpu",
                  "environment": _environment(self.gpus), "ranks": self.ranks, "spatial": list(self.split),
                  "steps": [asdict(r) for r in self.results]}
        (self.out / "gpu_check.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
        width = max(len(r.step) for r in self.results)
        print(f"\n{'step':<{width}}  status  seconds  notes")
        for r in self.results:
            print(f"{r.step:<{width}}  {r.status:<6}  {r.seconds:7.1f}  {r.notes}")
        print(f"\n{len(self.results) - len(failed)}/{len(self.results)} steps passed or skipped; "
              f"{self.out / 'gpu_check.json'}")
        return report


def _children() -> dict[int, list[int]]:
    """Every process's children (Linux /proc), by parent pid."""
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text(encoding="ascii", errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, parents first."""
    kids, found, todo = _children(), [], [pid]
    while todo:
        p = todo.pop(0)
        found.append(p)
        todo.extend(kids.get(p, []))
    return found


def end_tree(pid: int, grace: float = 10.0) -> list[int]:
    """End ``pid`` and everything below it: SIGTERM to each one's process group and to
    itself (torchrun's workers run in sessions of their own, so the launcher's group does
    not reach them), then SIGKILL to what is left after ``grace`` seconds. The tree is
    read before any signal, while the workers still have torchrun as their parent."""
    tree = descendants(pid)

    def signal_all(sig: int) -> None:
        for p in tree:
            for target in ("group", "pid"):
                try:
                    if target == "group":
                        os.killpg(os.getpgid(p), sig)
                    else:
                        os.kill(p, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in tree):
        time.sleep(0.1)
    signal_all(signal.SIGKILL)
    return tree


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace").rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _environment(gpus: int) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "host": platform.node(), "gpus": gpus}
    if gpus:
        env["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(gpus)]
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def _last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{") and (report := _json(line)) is not None:
            return report
    return None


def _json(text: str) -> dict[str, Any] | None:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:100] if lines else ""


def _summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "summary.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _with_summary(r: Result) -> Result:
    s = r.data.get("summary") or {}
    if s and r.status == "pass":
        mib = max(s.get("peak_memory_bytes_per_rank") or [0]) / 2**20
        reserved = max(s.get("peak_reserved_bytes_per_rank") or [0]) / 2**20
        r.notes = (f"{s.get('steps')} steps, {s.get('samples_per_s', 0):.2f} samples/s, "
                   f"peak memory {mib:.0f} MiB allocated, {reserved:.0f} MiB reserved per rank (summary.json)")
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU with gloo at tiny sizes")
    ap.add_argument("--out", default="runs/gpu_check", help="where logs, runs and gpu_check.json go")
    ap.add_argument("--skip", nargs="*", default=[], choices=["selfcheck", "layers", "train", "probe", "bench"],
                    help="leave out these steps")
    args = ap.parse_args(argv)
    check = Check(args)
    if not args.cpu and check.gpus == 0:
        print("gpu_check: no GPU visible (torch.cuda.is_available() is False); run with --cpu for the dry run")
        return 2
    if "selfcheck" not in args.skip:
        check.selfchecks()
    if "layers" not in args.skip:
        check.layers()
    if "train" not in args.skip:
        check.train("cosmoflow")
        check.train("unet3d")
    if "probe" not in args.skip:
        check.probe()
    if "bench" not in args.skip:
        check.bench()
    return 0 if check.summary()["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
