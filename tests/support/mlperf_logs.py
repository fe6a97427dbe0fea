"""Read an MLPerf log by key and run the HPC compliance checker on a result file, for the
submission tests (tests/launch/test_cluster_scripts.py, tests/launch/test_slurm_real.py)."""

import json
from pathlib import Path


def mllog(path: Path) -> dict[str, list[dict]]:
    """The ``:::MLLOG`` records of ``path``, by key, in order."""
    out: dict[str, list[dict]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith(":::MLLOG "):
            rec = json.loads(line[len(":::MLLOG "):])
            out.setdefault(rec["key"], []).append(rec)
    return out


def compliant(result: Path) -> bool:
    """The MLPerf HPC 3.0.0 compliance checker, in-process, on one result file."""
    from mlperf_logging.compliance_checker import mlp_compliance

    checker = mlp_compliance.make_checker("hpc", "3.0.0", True, False)
    valid, _, _, _ = mlp_compliance.main(str(result), "hpc_3.0.0/common.yaml", checker)
    return bool(valid)
