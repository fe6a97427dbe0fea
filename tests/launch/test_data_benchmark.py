"""The I/O benchmark prints per-codec ratios and block-read figures as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_benchmark_prints_json_for_every_codec_and_split(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark_io.py"), "--size", "32",
                          "--samples", "2", "--repeat", "1", "--spatial", "2,2x2x1", "--codecs", "none,zstd,blosc2",
                          "--dir", str(tmp_path)], capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(out.stdout)
    assert set(report["codecs"]) == {"none", "zstd", "blosc2"}
    assert 0.9 < report["codecs"]["none"]["compression_ratio"] <= 1.0
    assert report["codecs"]["zstd"]["compression_ratio"] > 1.5
    for entry in report["codecs"].values():
        assert entry["whole"]["decoded_MBps"] > 0
        for split, ranks in (("2x1x1", 2), ("2x2x1", 4)):
            block = entry["blocks"][split]
            assert block["ranks"] == ranks and block["rank_seconds"] > 0
            assert block["share_of_whole"] <= 1.1 / ranks + 0.02
