"""Security: checkpoints load with weights_only=True, no pickle in data files, no shell.

A static audit of the project's Python sources (every ``torch.load`` passes
``weights_only=True``, every ``np.load`` ``allow_pickle=False``, no ``pickle.load``, no
shell: no ``shell=True``, ``os.system`` or ``os.popen``, subprocess arguments as lists),
and two live checks: a checkpoint carrying a pickled object is refused without running
it, and a sample field stored as Python objects is rejected by the pre-flight check.
"""

from __future__ import annotations

import ast
import os
import pickle
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from cosmoflow.fields import SPEC
from parallel.data.check import check_file
from parallel.job import checkpoint

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for d in ("parallel", "cosmoflow", "unet3d", "scripts") for p in (REPO / d).rglob("*.py"))


def _keyword(call: ast.Call, name: str) -> object:
    for kw in call.keywords:
        if kw.arg == name and isinstance(kw.value, ast.Constant):
            return kw.value.value
    return "missing"


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def test_sources_load_safely_and_never_use_a_shell():
    problems = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = _dotted(node.func)
            where = f"{path.relative_to(REPO)}:{node.lineno}"
            if name == "torch.load" and _keyword(node, "weights_only") is not True:
                problems.append(f"{where}: torch.load without weights_only=True")
            if name in ("np.load", "numpy.load") and _keyword(node, "allow_pickle") is not False:
                problems.append(f"{where}: np.load without allow_pickle=False")
            if name in ("pickle.load", "pickle.loads", "os.system", "os.popen"):
                problems.append(f"{where}: {name}")
            if name.startswith("subprocess.") and _keyword(node, "shell") is True:
                problems.append(f"{where}: subprocess with shell=True")
            if name.startswith("subprocess.") and node.args and isinstance(node.args[0], (ast.Constant, ast.JoinedStr)):
                problems.append(f"{where}: subprocess with a command string")
    assert not problems, "\n".join(problems)


class _Payload:
    def __reduce__(self):  # unpickling this would create a file
        return (Path.touch, (Path(os.environ["PAYLOAD_MARK"]),))


def test_checkpoint_with_a_pickled_object_is_refused(tmp_path, monkeypatch):
    mark = tmp_path / "payload-ran"
    monkeypatch.setenv("PAYLOAD_MARK", str(mark))
    path = tmp_path / "evil.pt"
    with open(path, "wb") as fh:
        torch.save({"model": {}, "step": 1, "extra": _Payload()}, fh, pickle_module=pickle)
    with pytest.raises(checkpoint.CheckpointError, match=f"checkpoint {path} cannot be read"):
        checkpoint.load(path)
    assert not mark.exists()


def test_object_fields_in_sample_files_are_rejected(tmp_path):
    path = tmp_path / "s.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("volume", data=np.zeros((1, 4, 8, 8, 8), np.int16))
        f.create_dataset("target", data=np.array([["a", "b", "c", "d"]], dtype=object), dtype=h5py.string_dtype())
    problems = check_file(path, SPEC)
    assert any("field 'target' is object, want float32" in p for p in problems), problems
