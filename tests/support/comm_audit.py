"""Find torch.distributed communication calls in Python sources (for tests/unit/test_comm_layer.py).

A *communication call* is any collective or point-to-point function of torch.distributed
(``all_reduce``, ``all_gather*``, ``broadcast*``, ``reduce*``, ``scatter*``, ``gather*``,
``barrier``, ``monitored_barrier``, ``send``/``recv``/``isend``/``irecv``,
``batch_isend_irecv``, ``P2POp``, ``all_to_all*``, the ``*_object*`` ones), referenced
through any alias of the module or one of its submodules, or imported by name; and any
import of torch's autograd or functional collectives (``torch.distributed.nn``,
``torch.distributed._functional_collectives``).

Not communication for this purpose: the process-group lifecycle (``init_process_group``,
``destroy_process_group``, ``new_group``), queries (``get_rank``, ``get_world_size``,
``is_initialized``, ``get_backend``), ``ReduceOp``, ``TCPStore`` (the watchdog's own store
connection) and exceptions such as ``DistError``.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

_COLLECTIVE = re.compile(
    r"^_?(all_reduce|all_gather|all_to_all|broadcast|reduce|scatter|gather|barrier|monitored_barrier"
    r"|send|recv|isend|irecv|batch_isend_irecv|P2POp)")
_NOT_COLLECTIVE = {"reduce_op"}  # the deprecated alias of ReduceOp
_FORBIDDEN_MODULES = ("torch.distributed.nn", "torch.distributed._functional_collectives")


def is_communication(name: str) -> bool:
    return name not in _NOT_COLLECTIVE and (bool(_COLLECTIVE.match(name)) or "_object" in name)


@dataclass(frozen=True)
class Call:
    path: str
    line: int
    function: str
    name: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.function}: {self.name}"


class _Finder(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.aliases: set[str] = set()  # names bound to torch.distributed or a submodule
        self.torch_names: set[str] = set()  # names bound to torch itself
        self.scope: list[str] = []
        self.found: list[Call] = []

    def _add(self, node: ast.AST, name: str) -> None:
        self.found.append(Call(self.path, getattr(node, "lineno", 0), ".".join(self.scope) or "<module>", name))

    def _scoped(self, node: ast.AST, name: str) -> None:
        self.scope.append(name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._scoped(node, node.name)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scoped(node, node.name)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name.startswith(_FORBIDDEN_MODULES):
                self._add(node, f"import {a.name}")
            if a.name == "torch" or (a.name.startswith("torch.") and a.asname is None):
                self.torch_names.add(a.asname or "torch")
            elif a.name.startswith("torch.distributed") and a.asname:
                self.aliases.add(a.asname)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        for a in node.names:
            full = f"{module}.{a.name}"
            if full.startswith(_FORBIDDEN_MODULES) or module.startswith(_FORBIDDEN_MODULES):
                self._add(node, f"from {module} import {a.name}")
            elif module == "torch" and a.name == "distributed":
                self.aliases.add(a.asname or a.name)
            elif module.startswith("torch.distributed"):
                if is_communication(a.name):
                    self._add(node, f"from {module} import {a.name}")
                elif not a.name[:1].isupper():  # a submodule such as distributed_c10d
                    self.aliases.add(a.asname or a.name)

    def _is_dist(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.aliases
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id in self.torch_names:
                return node.attr == "distributed"
            return self._is_dist(node.value)  # torch.distributed.distributed_c10d, dist.distributed_c10d
        return False

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if is_communication(node.attr) and self._is_dist(node.value):
            self._add(node, node.attr)
        self.generic_visit(node)


def find_calls(source: str, path: str = "<source>") -> list[Call]:
    """Every communication call (or reference, or import) in ``source``."""
    finder = _Finder(path)
    finder.visit(ast.parse(source, filename=path))
    return finder.found


def audit(root: Path, folders: tuple[str, ...]) -> list[Call]:
    """``find_calls`` over every .py file under ``root/folder`` for each folder."""
    calls: list[Call] = []
    for folder in folders:
        for file in sorted((root / folder).rglob("*.py")):
            rel = file.relative_to(root).as_posix()
            calls += find_calls(file.read_text(encoding="utf-8"), rel)
    return calls
