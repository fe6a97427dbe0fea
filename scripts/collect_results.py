#!/usr/bin/env python3
"""Collect training runs into the MLPerf results layout and check every result.

    python scripts/collect_results.py --mode weak --system local --org spatialcnn \\
        --out runs/submission runs/local_weak_123/run_*

Each RUN_DIR's ``mlperf.log`` becomes

    <out>/<org>/results/<system>/<strong|weak>/cosmoflow/result_<i>.txt   (MLPerf HPC)
    <out>/<org>/results/<system>/unet3d/result_<i>.txt                    (MLPerf Training)

and ``<out>/<org>/systems/<system>.json`` is written (from ``--system-json`` and what this
machine reports) unless it exists. Every CosmoFlow result then goes through
``python -m mlperf_logging.compliance_checker --usage hpc --ruleset 3.0.0`` (its log:
``RUN_DIR/compliance_checker.log``) and the system file through the system description
checker. Strong scaling appends results after those already there (a submission needs 10);
weak scaling replaces the folder's results (one experiment: its instances ran together)
and reports the score, max(run_stop) - min(run_start) over the instances that passed.
``--package-check`` also runs the package checker over ``<out>/<org>`` (it wants 10
results per benchmark, so a small experiment fails it; its verdict is reported, not
enforced). U-Net logs use the Training keys and are checked with the Training checker
(``--usage training --ruleset 4.0.0``): the closed ``unet3d`` rules also fix the KiTS19
sample counts (168/42), so a synthetic set belongs to the open division.

Exit status: 0 when every result (and the system file) passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

HPC_RULESET = "3.0.0"
TRAINING_RULESET = "4.0.0"


def read_log(path: Path) -> list[dict]:
    """The ``:::MLLOG`` records of a log, in order."""
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith(":::MLLOG "):
            out.append(json.loads(line[len(":::MLLOG "):]))
    return out


def run_times(records: list[dict]) -> tuple[float | None, float | None, str | None]:
    """run_start and run_stop (ms) and the run_stop status."""
    start = stop = status = None
    for rec in records:
        if rec["key"] == "run_start" and start is None:
            start = rec["time_ms"]
        elif rec["key"] == "run_stop" and stop is None:
            stop, status = rec["time_ms"], (rec.get("metadata") or {}).get("status")
    return start, stop, status


def check_result(result: Path, usage: str, ruleset: str, log_output: Path) -> bool:
    """Run the MLPerf compliance checker on one result file; True when it passes."""
    cmd = [sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", usage,
           "--ruleset", ruleset, "--log_output", str(log_output), str(result)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode == 0


def _cpuinfo() -> tuple[str, int, int]:
    """Processor model, sockets and physical cores of this machine (best effort)."""
    model, sockets, cores = platform.processor() or "unknown", set(), set()
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return model, 1, os.cpu_count() or 1
    phys = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name":
            model = value
        elif key == "physical id":
            phys = value
            sockets.add(value)
        elif key == "core id":
            cores.add((phys, value))
    return model, max(1, len(sockets)), len(cores) or os.cpu_count() or 1


def _memory_gb() -> str:
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 1024 ** 2:.0f} GB"
    except OSError:
        pass
    return "unknown"


def _gpu() -> tuple[str, str]:
    """Name and memory of GPU 0 from nvidia-smi, or N/A."""
    if shutil.which("nvidia-smi"):
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True)
        if proc.returncode == 0 and proc.stdout.strip():
            name, _, mem = proc.stdout.splitlines()[0].partition(",")
            return name.strip(), mem.strip()
    return "N/A", "N/A"


def system_description(args: argparse.Namespace) -> dict:
    """Every field the system description checker requires: given ones first, then
    what this machine (the first node of the job) reports."""
    model, sockets, cores = _cpuinfo()
    gpu, gpu_mem = _gpu()
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "unknown"
    status = args.status
    if args.model == "unet3d":  # the Training checker wants its availability wording
        status = {"research": "Research, Development, or Internal (RDI)", "onprem": "Available on-premise",
                  "cloud": "Available cloud", "preview": "Preview"}.get(status, status)
    desc = {
        "submitter": args.org, "division": args.division, "status": status,
        "system_name": args.system, "number_of_nodes": str(args.nodes),
        "host_processors_per_node": str(sockets), "host_processor_model_name": model,
        "host_processor_core_count": str(cores), "host_processor_vcpu_count": str(os.cpu_count() or 1),
        "host_processor_frequency": "", "host_processor_caches": "", "host_processor_interconnect": "",
        "host_memory_capacity": _memory_gb(), "host_storage_type": "", "host_storage_capacity": "",
        "host_networking": "", "host_networking_topology": "", "host_memory_configuration": "",
        "accelerators_per_node": str(args.accelerators_per_node),
        "accelerator_model_name": gpu if args.accelerators_per_node else "N/A",
        "accelerator_host_interconnect": "", "accelerator_frequency": "", "accelerator_on-chip_memories": "",
        "accelerator_memory_configuration": "",
        "accelerator_memory_capacity": gpu_mem if args.accelerators_per_node else "N/A",
        "accelerator_interconnect": "", "accelerator_interconnect_topology": "", "cooling": "",
        "hw_notes": "", "framework": f"PyTorch {torch_version} (spatialcnn)",
        "other_software_stack": f"Python {platform.python_version()}, mlperf-logging {metadata.version('mlperf-logging')}",
        "operating_system": platform.platform(), "sw_notes": "",
    }
    if args.system_json:
        desc.update(json.loads(Path(args.system_json).read_text(encoding="utf-8")))
    return desc


def check_system(path: Path, usage: str, ruleset: str) -> bool:
    from mlperf_logging.system_desc_checker.system_desc_checker import check_system_desc

    valid, _, _, _ = check_system_desc(str(path), usage, ruleset)
    return bool(valid)


def collect(args: argparse.Namespace) -> int:
    hpc = args.model == "cosmoflow"
    org_dir = Path(args.out) / args.org
    if hpc:
        bench_dir = org_dir / "results" / args.system / args.mode / args.model
    else:
        bench_dir = org_dir / "results" / args.system / args.model
    bench_dir.mkdir(parents=True, exist_ok=True)
    usage, ruleset = ("hpc", HPC_RULESET) if hpc else ("training", TRAINING_RULESET)

    existing = sorted(bench_dir.glob("result_*.txt"))
    if args.mode == "weak" or args.replace:
        for old in existing:
            old.unlink()
        existing = []
    next_index = 1 + max((int(m.group(1)) for p in existing if (m := re.fullmatch(r"result_(\d+)\.txt", p.name))),
                         default=-1)

    ok = True
    rows = []
    for i, run in enumerate(Path(r) for r in args.runs):
        log = run / "mlperf.log"
        if not log.is_file():
            print(f"collect: {run}: no mlperf.log, skipped")
            ok = False
            continue
        result = bench_dir / f"result_{next_index + i}.txt"
        shutil.copyfile(log, result)
        passed = check_result(result, usage, ruleset, run / "compliance_checker.log")
        start, stop, status = run_times(read_log(result))
        seconds = (stop - start) / 1000 if start is not None and stop is not None else None
        rows.append({"result": str(result), "run": str(run), "status": status, "seconds": seconds,
                     "start_ms": start, "stop_ms": stop, "checker": "passed" if passed else "FAILED"})
        print(f"collect: {result} <- {log}: status {status}, "
              f"{'%.3f s' % seconds if seconds is not None else 'no time'}, compliance checker "
              f"{'passed' if passed else 'FAILED (see ' + str(run / 'compliance_checker.log') + ')'}")
        if not passed:
            ok = False

    system_file = org_dir / "systems" / f"{args.system}.json"
    if not system_file.is_file() or args.system_json:
        system_file.parent.mkdir(parents=True, exist_ok=True)
        system_file.write_text(json.dumps(system_description(args), indent=2) + "\n", encoding="utf-8")
    sys_ok = check_system(system_file, usage, ruleset)
    print(f"collect: {system_file}: system description checker {'passed' if sys_ok else 'FAILED'}")
    ok = ok and sys_ok

    summary = {"mode": args.mode, "model": args.model, "results": rows, "ok": ok}
    good = [r for r in rows if r["checker"] == "passed" and r["start_ms"] is not None and r["stop_ms"] is not None]
    if args.mode == "weak" and good:
        ttt = (max(r["stop_ms"] for r in good) - min(r["start_ms"] for r in good)) / 1000
        summary.update(instances=len(rows), models_passed=len(good), time_to_train_all_s=round(ttt, 3),
                       models_per_minute=round(len(good) / (ttt / 60), 3) if ttt > 0 else None)
        print(f"collect: weak scaling: {len(good)}/{len(rows)} models passed, time to train all "
              f"{ttt:.3f} s = max(run_stop) - min(run_start)")
    if args.package_check:
        pkg_log = Path(args.out) / f"package_checker_{args.org}.log"
        proc = subprocess.run([sys.executable, "-m", "mlperf_logging.package_checker", str(org_dir), usage,
                               ruleset, "--log_output", str(pkg_log)], capture_output=True, text=True)
        verdict = "passed" if "FOUND NO ERRORS" in proc.stdout + proc.stderr else "found errors"
        summary["package_checker"] = verdict
        print(f"collect: package checker {verdict} (log {pkg_log}; not enforced)")
    print(json.dumps(summary))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("runs", nargs="+", help="run directories (run.dir of each run), each holding mlperf.log")
    p.add_argument("--mode", choices=["strong", "weak"], default="strong")
    p.add_argument("--system", required=True, help="system name: results/<system>, systems/<system>.json")
    p.add_argument("--org", default="spatialcnn", help="submitting organisation (top folder)")
    p.add_argument("--out", default="runs/submission", help="where <org>/ is (default runs/submission)")
    p.add_argument("--model", choices=["cosmoflow", "unet3d"], default="cosmoflow")
    p.add_argument("--division", choices=["closed", "open"], default="closed")
    p.add_argument("--status", default="research", help="system status in systems/<system>.json")
    p.add_argument("--nodes", type=int, default=1, help="nodes of the system (systems json)")
    p.add_argument("--accelerators-per-node", type=int, default=0, help="GPUs per node (0: CPU-only)")
    p.add_argument("--system-json", help="JSON file with system description fields (override what is detected)")
    p.add_argument("--replace", action="store_true", help="strong scaling: drop earlier results first")
    p.add_argument("--package-check", action="store_true", help="also run the MLPerf package checker (reported only)")
    return collect(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
