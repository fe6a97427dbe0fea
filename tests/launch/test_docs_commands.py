"""The docs tell the truth: the CI subset of the commands in README.md and docs/*.md runs as
written at a small size (scripts/check_docs.py; its rules: tests/unit/test_check_docs.py)."""

import re
import subprocess
import sys

from train_helpers import REPO, env

sys.path.insert(0, str(REPO / "scripts"))



def test_ci_subset_of_the_documented_commands_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "check_docs.py"), "--workdir", str(tmp_path)],
                          env=env(), cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert re.search(r"check_docs: (\d+) passed, 0 failed", proc.stdout) and " 0 without a rule" in proc.stdout
