"""The results table of docs/performance.md is generated from the committed result records
(docs/results/*.jsonl) and checked against them, so a figure in the doc cannot drift from
its record; links into performance.md land on its headings."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from train_helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
import results_table  # noqa: E402

from parallel.bench import record  # noqa: E402

DOC = REPO / "docs" / "performance.md"
RESULTS = REPO / "docs" / "results"


def test_the_committed_doc_holds_the_records_table(capsys):
    assert results_table.main(["--check", str(DOC)]) == 0, capsys.readouterr()
    shown = [r for r in results_table.ROWS if results_table.latest(r, results_table.load_records([RESULTS]))]
    assert len(shown) >= 5  # the current table is measured, not empty
    text = DOC.read_text()
    block = text[text.index(results_table.BEGIN):text.index(results_table.END)]
    assert block.count("\n| ") == len(shown) + 2  # header, separator, one row per recorded figure


def _copy_records(tmp_path: Path) -> Path:
    out = tmp_path / "records"
    shutil.copytree(RESULTS, out)
    return out


def _shown_record(records: Path) -> tuple[Path, int, results_table.Row, str]:
    """The file, line, row and figure of the record behind the table's first row."""
    recs = results_table.load_records([records])
    for row in results_table.ROWS:
        rec = results_table.latest(row, recs)
        if rec is not None:
            where, line = rec["_where"].rsplit(":", 1)
            return Path(where), int(line), row, row.figures[0]
    raise AssertionError("no record behind any row")


def test_a_changed_figure_in_a_record_fails_the_check(tmp_path, capsys):
    records = _copy_records(tmp_path)
    path, line, row, figure = _shown_record(records)
    lines = path.read_text().splitlines()
    rec = json.loads(lines[line - 1])
    rec["figures"][figure] = round(rec["figures"][figure] + 0.123, 6)
    lines[line - 1] = json.dumps(rec)
    path.write_text("\n".join(lines) + "\n")
    assert results_table.main(["--check", str(DOC), "--records", str(records)]) == 1
    out = capsys.readouterr()
    assert f"{rec['figures'][figure]:.3f}" in out.out and "differs from the records" in out.err
    # --write puts the changed figure into a copy of the doc, which then checks clean.
    doc = tmp_path / "performance.md"
    shutil.copy(DOC, doc)
    assert results_table.main(["--write", str(doc), "--records", str(records)]) == 0
    assert results_table.main(["--check", str(doc), "--records", str(records)]) == 0


def test_only_a_record_of_the_same_quantity_replaces_a_row(tmp_path, capsys):
    """A later record whose command changed what is measured (a model override) is another
    quantity: the row keeps its record. A later one that only ran more trials replaces it."""
    records = _copy_records(tmp_path)
    path, line, row, figure = _shown_record(records)
    rec = json.loads(path.read_text().splitlines()[line - 1])
    later = {**rec, "date": "2999-01-01T00:00:00Z", "figures": {**rec["figures"], figure: 9.999}}
    with open(path, "a") as f:
        f.write(json.dumps({**later, "case": {**rec["case"], "set": ["model.conv_filters=4"]}}) + "\n")
    assert results_table.main(["--check", str(DOC), "--records", str(records)]) == 0
    with open(path, "a") as f:
        f.write(json.dumps({**later, "case": {**rec["case"], "trials": 99}}) + "\n")
    assert results_table.main(["--check", str(DOC), "--records", str(records)]) == 1
    assert "9.999" in capsys.readouterr().out


def test_a_malformed_record_names_its_file_line_and_key(tmp_path, capsys):
    records = _copy_records(tmp_path)
    bad = records / "zz_bad.jsonl"
    bad.write_text(json.dumps({"benchmark": "layer", "case": {}, "figures": {}}) + "\n")
    assert results_table.main(["--check", str(DOC), "--records", str(records)]) == 2
    err = capsys.readouterr().err
    assert "zz_bad.jsonl:1" in err and "'args'" in err and "'machine'" in err
    (tmp_path / "nomarkers.md").write_text("# no table\n")
    assert results_table.main(["--check", str(tmp_path / "nomarkers.md")]) == 2
    assert "results:begin" in capsys.readouterr().err


def test_a_record_says_what_produced_it(tmp_path):
    """``scripts/benchmark.py --record`` writes these fields; here from a made-up summary."""
    summary = {"kind": "summary", "command": "layer", "load_before": [1.0, 2.0, 3.0], "halo_fair_2x1x1": 1.01,
               "includes": "what the figures count", "plot": None, "load_after": [1.5, 2.0, 3.0]}
    args = argparse.Namespace(command="layer", size=32, trials=9, plot=None, out=None, record=tmp_path / "r.jsonl")
    defaults = argparse.Namespace(command="layer", size=64, trials=9, plot=None, out=None, record=None)
    argv = ["layer", "--size", "32", "--record", str(tmp_path / "r.jsonl")]
    record.append(tmp_path / "r.jsonl", record.make(summary, args, defaults, argv, 0.0, tmp_path / "r.jsonl"))
    [rec] = record.read(tmp_path / "r.jsonl")
    assert rec["benchmark"] == "layer" and rec["case"] == {"size": 32}
    assert rec["figures"] == {"halo_fair_2x1x1": 1.01} and rec["includes"] == "what the figures count"
    assert rec["command"] == "python scripts/benchmark.py layer --size 32"
    assert rec["load_before"] == [1.0, 2.0, 3.0] and rec["load_after"] == [1.5, 2.0, 3.0]
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=REPO, capture_output=True, text=True)
    assert rec["git"]["commit"] == head.stdout.strip() and isinstance(rec["git"]["dirty"], bool)
    import torch

    assert rec["torch"] == torch.__version__ and rec["machine"]["cores"] >= 1 and rec["machine"]["cpu"]
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$", rec["date"])


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_into_performance_md_land_on_its_headings():
    anchors = {_anchor(m) for m in re.findall(r"^#+ (.+)$", DOC.read_text(), re.M)}
    links = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        links += [(path.name, a) for a in re.findall(r"performance\.md#([\w\-]+)", path.read_text())]
    assert links, "no links into performance.md found: the extractor is broken"
    assert not [x for x in links if x[1] not in anchors], f"links to headings that do not exist: {links}"
