"""The test tiers are folders (tests/conftest.py): a test gets its folder's marker, a test
outside the tier folders or with a tier marker of its own is refused at collection, and
the SLOW and NIGHTLY lists name only tests that exist."""

import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    """A copy of tests/conftest.py and tests/support with the given test files beside them."""
    root = tmp_path / "tests"
    root.mkdir()
    shutil.copy(TESTS / "conftest.py", root / "conftest.py")
    shutil.copytree(TESTS / "support", root / "support", ignore=shutil.ignore_patterns("__pycache__", "data", "slurm"))
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def _collect(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "--rootdir", str(root), "-c", str(REPO / "pyproject.toml"), str(root),
                           *args], capture_output=True, text=True, timeout=120, cwd=root.parent)


def test_each_test_gets_its_folders_tier(tmp_path):
    root = _tree(tmp_path, {"unit/test_a.py": "def test_a():\n    pass\n",
                            "ranks/test_b.py": "def test_b():\n    pass\n",
                            "launch/test_c.py": "def test_c():\n    pass\n"})
    for tier, want in (("unit", "test_a"), ("ranks", "test_b"), ("launch", "test_c")):
        proc = _collect(root, "-m", tier)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        ids = [line for line in proc.stdout.splitlines() if "::" in line]
        assert len(ids) == 1 and ids[0].endswith(f"{tier}/test_{want[-1]}.py::{want}"), proc.stdout


def test_a_test_outside_the_tier_folders_is_refused(tmp_path):
    root = _tree(tmp_path, {"unit/test_a.py": "def test_a():\n    pass\n",
                            "test_loose.py": "def test_loose():\n    pass\n"})
    proc = _collect(root)
    assert proc.returncode != 0
    assert "test_loose.py lie outside the tier folders" in proc.stdout + proc.stderr


def test_a_tier_marker_of_its_own_is_refused(tmp_path):
    root = _tree(tmp_path, {"unit/test_a.py": "import pytest\n\n\n@pytest.mark.launch\ndef test_a():\n    pass\n"})
    proc = _collect(root)
    assert proc.returncode != 0
    assert "carries a tier marker: its folder (tests/unit) sets the tier" in proc.stdout + proc.stderr


def test_slow_and_nightly_name_only_tests_that_exist(tmp_path):
    """A SLOW entry whose file is collected but whose test is gone stops the run by name."""
    root = _tree(tmp_path, {"launch/test_elastic.py": "def test_renamed():\n    pass\n"})
    proc = _collect(root)
    assert proc.returncode != 0
    assert "launch/test_elastic.py::test_a_node_dies_and_the_job_finishes_on_the_survivors" in proc.stdout + proc.stderr
