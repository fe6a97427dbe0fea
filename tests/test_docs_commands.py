"""The docs tell the truth: every shell command of README.md and docs/*.md has a rule in
scripts/check_docs.py, the CI subset runs as written at a small size, and figures the docs
state are the code's."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from train_helpers import REPO, env

sys.path.insert(0, str(REPO / "scripts"))
import check_docs  # noqa: E402


@pytest.mark.unit
def test_every_documented_command_has_a_rule():
    found = check_docs.commands()
    assert len(found) > 30  # README and docs/ hold dozens; an extractor that finds none must fail
    missing = [f"{c.where}: {c.text}" for c in found if c.rule is None]
    assert not missing, "commands without a rule in scripts/check_docs.py RULES:\n" + "\n".join(missing)
    assert any(c.rule.tier == "ci" for c in found)
    for c in found:
        if c.rule.tier == "skip":
            assert c.rule.why, f"{c.where}: a skipped command says why"


@pytest.mark.unit
def test_extraction_of_fenced_indented_and_continued_commands(tmp_path, monkeypatch):
    doc = tmp_path / "doc.md"
    doc.write_text("""Text.

```bash
python -m a.b x=1   # a comment
torchrun --nproc-per-node 2 -m c.d \\
    y=2 'z=#3'
```

```python
print("not a command")
```

    OMP_NUM_THREADS=1 mpirun -n 2 python -m e.f \\
        g=4                                        # torchrun
    ERROR some log line, not a command
""")
    monkeypatch.setattr(check_docs, "REPO", tmp_path)
    got = [(c.text, c.where) for c in check_docs.extract(doc)]
    assert got == [("python -m a.b x=1", "doc.md:4"),
                   ("torchrun --nproc-per-node 2 -m c.d y=2 'z=#3'", "doc.md:5"),
                   ("OMP_NUM_THREADS=1 mpirun -n 2 python -m e.f g=4", "doc.md:13")]


@pytest.mark.unit
def test_the_chunk_shape_data_md_states():
    from parallel.data import choose_chunks

    text = (REPO / "docs" / "data.md").read_text()
    m = re.search(r"with `--splits 2,4,2x2x1` gives\s+chunks `\(([\d, ]+)\)`", text)
    assert m, "docs/data.md no longer states the example chunk shape"
    stated = tuple(int(v) for v in m.group(1).split(","))
    assert stated == choose_chunks((128, 128, 128), [[2, 1, 1], [4, 1, 1], [2, 2, 1]], 4, 2)


def test_ci_subset_of_the_documented_commands_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "check_docs.py"), "--workdir", str(tmp_path)],
                          env=env(), cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert re.search(r"check_docs: (\d+) passed, 0 failed", proc.stdout) and " 0 without a rule" in proc.stdout
