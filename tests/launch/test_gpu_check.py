"""scripts/gpu_check.sh --cpu: the prepared GPU check's steps on the CPU with gloo at tiny
sizes: its self-checks and probe in CI; every step (layer tests, a nested pytest of cases
the ranks tier runs anyway, and short bf16 trainings with resume and predict, which the
launch tier proves on the CPU) in the nightly tier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _dry_run(out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("SPATIALCNN_TEST_DEVICE", None)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu", "--out", str(out), *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["ok"] and report["mode"] == "cpu dry run"
    steps = {s["step"]: s for s in report["steps"]}
    assert all(s["status"] == "pass" for s in steps.values()), steps
    return proc, steps


def test_gpu_check_cpu_dry_run_passes(tmp_path):
    # CI: the script itself (its steps, table and report) on its self-checks and probe
    proc, steps = _dry_run(tmp_path, "--skip", "layers", "train")
    assert sorted(n for n in steps if n.startswith("selfcheck")) == ["selfcheck 1 rank(s) gloo bf16",
                                                                      "selfcheck 2 rank(s) gloo bf16"]
    # torchrun, 2 ranks, bf16 on the path every device takes: the split convolutions summed in
    # float32 from rounded inputs (~0.015 relative); summed in bf16, as GPUs once did, 0.149 against 0.05
    split = steps["selfcheck 2 rank(s) gloo bf16"]["data"]
    assert split["max_rel_diff"] <= split["tolerance"] / 2, split
    assert any(name.startswith("probe") for name in steps)
    assert not any(name.startswith(("layer", "train")) for name in steps)
    assert "status  seconds  notes" in proc.stdout  # the table


def test_gpu_check_cpu_dry_run_whole(tmp_path):
    # nightly: every step; its layer tests and bf16 trainings repeat what CI proves elsewhere
    _, steps = _dry_run(tmp_path)
    for expected in ("train cosmoflow bf16", "resume cosmoflow bf16", "predict cosmoflow bf16",
                     "train unet3d bf16", "resume unet3d bf16", "predict unet3d bf16"):
        assert expected in steps, sorted(steps)
    assert steps["resume cosmoflow bf16"]["data"]["summary"]["steps"] == 4
    assert any(name.startswith("layer tests") for name in steps), sorted(steps)
