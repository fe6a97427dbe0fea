"""The package layout issue 15 settled: the framework (``parallel/``) imports no model
family, and no source file grows past 400 lines."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("cosmoflow", "unet3d")
MAX_LINES = 400


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            names.add(str(node.args[0].value).split(".")[0])
    return names


@pytest.mark.unit
def test_the_framework_imports_no_model_family():
    files = sorted((REPO / "parallel").rglob("*.py"))
    assert len(files) > 50
    found = {str(p.relative_to(REPO)): sorted(_imports(p) & set(FAMILIES)) for p in files}
    assert not {k: v for k, v in found.items() if v}, found


@pytest.mark.unit
def test_the_import_audit_sees_each_form(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import cosmoflow.model\nfrom unet3d import family\n")
    assert _imports(probe) >= {"cosmoflow", "unet3d"}
    probe.write_text("import importlib\nimportlib.import_module('unet3d.train')\n")
    assert "unet3d" in _imports(probe)


@pytest.mark.unit
def test_no_source_file_over_400_lines():
    files = [p for d in ("parallel", "cosmoflow", "unet3d", "scripts", "tests") for p in (REPO / d).rglob("*.py")]
    long = {str(p.relative_to(REPO)): n for p in files
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, long
