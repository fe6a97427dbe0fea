"""scripts/check_docs.py's own logic: every shell command of README.md and docs/*.md has a
rule, commands are extracted from fenced, indented and continued blocks, and a figure the
docs state is the code's. (The CI subset run as written: tests/launch/test_docs_commands.py.)"""

import re
import sys

from train_helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))



import check_docs  # noqa: E402


def test_every_documented_command_has_a_rule():
    found = check_docs.commands()
    assert len(found) > 30  # README and docs/ hold dozens; an extractor that finds none must fail
    missing = [f"{c.where}: {c.text}" for c in found if c.rule is None]
    assert not missing, "commands without a rule in scripts/check_docs.py RULES:\n" + "\n".join(missing)
    assert any(c.rule.tier == "ci" for c in found)
    for c in found:
        if c.rule.tier == "skip":
            assert c.rule.why, f"{c.where}: a skipped command says why"



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



def test_the_chunk_shape_data_md_states():
    from parallel.data import choose_chunks

    text = (REPO / "docs" / "data.md").read_text()
    m = re.search(r"with `--splits 2,4,2x2x1` gives\s+chunks `\(([\d, ]+)\)`", text)
    assert m, "docs/data.md no longer states the example chunk shape"
    stated = tuple(int(v) for v in m.group(1).split(","))
    assert stated == choose_chunks((128, 128, 128), [[2, 1, 1], [4, 1, 1], [2, 2, 1]], 4, 2)
