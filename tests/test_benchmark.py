"""scripts/benchmark.py runs its subcommands and prints JSON lines ending with a summary
(tiny sizes: these check the plumbing, not the speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float = 240) -> list[dict]:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark.py"), *args], capture_output=True,
                         text=True, timeout=timeout, check=True, cwd=ROOT)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert rows and rows[-1]["kind"] == "summary"
    return rows


def test_layer_prints_the_halo_overhead():
    rows = _run("layer", "--size", "12", "--channels", "2", "--trials", "2")
    assert rows[0]["kind"] == "layer" and rows[0]["local_block"] == [6, 12, 12]
    assert set(rows[0]["overhead"]) == {"overlap", "blocking"}
    assert rows[-1]["halo_overhead_2x1x1"] > 0
