"""``parallel.spatial=auto`` in a real 2-rank training job: rank 0 decides, every rank uses
its choice, even where the other ranks' calibration would choose differently."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from cosmoflow.family import FAMILY, CosmoFlowJob
from parallel import plan
from parallel.job.config import to_dataclass
from parallel.runtime.launch import free_port
from parallel.train.checks import autosplit, read_facts
from parallel.train.cli import CONFIG_ROOT, register
from train_helpers import REPO, env, prepare

TIMEOUT = 240


def _choice(cfg: CosmoFlowJob, calibration: Path, monkeypatch) -> list[int]:
    monkeypatch.setenv("SPATIALCNN_CALIBRATION", str(calibration))
    return autosplit.auto_spatial(cfg, FAMILY, read_facts(cfg.data, FAMILY), world_size=2)


def test_rank0_chooses_the_split_for_everyone(tmp_path: Path, monkeypatch):
    data = prepare("cosmoflow", tmp_path / "data", 16, 4, 2)
    overrides = [f"data.dir={data}", "parallel.spatial=auto", "train.epochs=1", "train.global_batch_size=2",
                 f"run.dir={tmp_path / 'run'}", "data.val_subdir=val"]
    register(FAMILY)
    with initialize_config_dir(config_dir=str(CONFIG_ROOT / "cosmoflow"), version_base=None):
        cfg = to_dataclass(compose(config_name="smoke", overrides=overrides), CosmoFlowJob)
    # Rank 0's machine: every layer of the data-parallel step measured as slow -> spatial 2.
    with torch.device("meta"):
        model = FAMILY.build_model(cfg.model, (16, 16, 16))
    layers = plan.trace(model, (4, 16, 16, 16))
    slow_data = {plan.op_key(l, op, 1): 1.0 for l, op in zip(layers, plan.local_ops(layers, (1, 1, 1)))}
    fast = tmp_path / "rank0.json"
    fast.write_text(json.dumps({"layer_seconds": slow_data}))
    # Rank 1's machine: a split layer costs a second -> data 2.
    slow = tmp_path / "rank1.json"
    slow.write_text(json.dumps({"spatial_layer_overhead": 1.0}))
    assert _choice(cfg, fast, monkeypatch) == [2, 1, 1]
    assert _choice(cfg, slow, monkeypatch) == [1, 1, 1]

    port = str(free_port())
    procs = []
    for rank, cal in enumerate((fast, slow)):
        e = env() | {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
                     "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "77", "MASTER_PORT": port,
                     "SPATIALCNN_CALIBRATION": str(cal)}
        procs.append(subprocess.Popen([sys.executable, "-m", "cosmoflow.train", "--config-name", "smoke", *overrides],
                                      env=e, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=TIMEOUT)[0])
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["grid"] == {"world": 2, "data": 1, "spatial": [2, 1, 1]}
    assert "parallel.spatial=auto chose 2x1x1 for 2 ranks" in outs[0]
