"""The package layout: the framework (``parallel/``) imports no model family; its folders
are layers, each importing only from itself and the layers below it (``LAYERS``, drawn in
docs/parallel.md's module map); no import circle; no source file grows past 400 lines."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
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


def test_the_framework_imports_no_model_family():
    files = sorted((REPO / "parallel").rglob("*.py"))
    assert len(files) > 50
    found = {str(p.relative_to(REPO)): sorted(_imports(p) & set(FAMILIES)) for p in files}
    assert not {k: v for k, v in found.items() if v}, found


def test_the_import_audit_sees_each_form(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import cosmoflow.model\nfrom unet3d import family\n")
    assert _imports(probe) >= {"cosmoflow", "unet3d"}
    probe.write_text("import importlib\nimportlib.import_module('unet3d.train')\n")
    assert "unet3d" in _imports(probe)


def test_no_source_file_over_400_lines():
    files = [p for d in ("parallel", "cosmoflow", "unet3d", "scripts", "tests") for p in (REPO / d).rglob("*.py")]
    long = {str(p.relative_to(REPO)): n for p in files
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, long


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = REPO, package: str = "parallel") -> dict[str, set[str]]:
    """Which modules of ``package`` each of its modules imports, read from the source with
    ``ast``: module-level and function-level imports alike (a lazy import that closes a
    circle still ties the two modules together). ``from a import b`` counts as an import of
    ``a.b`` where that is a module, else of ``a``; a package's ``__init__`` that the import
    system runs on the way to a submodule is not counted (it would make every package a
    circle with its own submodules)."""
    files = {_module_name(p, root): p for p in (root / package).rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for t in targets:
                if t.split(".")[0] == package and (target := resolve(t)) not in (None, mod):
                    graph[mod].add(target)  # type: ignore[arg-type]
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each holds a circle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle_under_parallel():
    graph = import_graph()
    assert len(graph) > 50 and "parallel.train.checks.fit" in graph["parallel.train.checks.samples"]
    circles = import_circles(graph)
    assert not circles, [{m: sorted(graph[m] & set(c)) for m in c} for c in circles]


def test_the_circle_audit_sees_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / "parallel"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from parallel.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import g\n")
    (pkg / "c.py").write_text("import parallel.a\n")
    graph = import_graph(tmp_path)
    assert graph["parallel.a"] == {"parallel.sub.b"} and graph["parallel.sub.b"] == {"parallel.a"}
    assert import_circles(graph) == [["parallel.a", "parallel.sub.b"]]


LAYERS: tuple[tuple[str, ...], ...] = (
    # bottom first: a module imports only its own folder and the folders of lower rows
    ("parallel.partition", "parallel.placement"),  # a dim cut into blocks | ranks on hosts
    ("parallel.grid",),                         # the process grid: data x spatial
    ("parallel.comm",),                         # every collective and message
    ("parallel.runtime", "parallel.split"),     # the process around the ranks | tensors split in space
    ("parallel.layers",),                       # every split op
    ("parallel.model", "parallel.data"),        # a model in its split form | each rank's block from storage
    ("parallel.verify", "parallel.kfac"),       # the check against serial | second-order preconditioning
    ("parallel.job",),                          # what a training job is: config, families, checkpoint files
    ("parallel.plan",),                         # the cost model, its choice of split and its command line
    ("parallel",),                              # the public API (parallel/__init__.py) and its entry points
    ("parallel.infer",),                        # whole cases: sliding window, evaluation, prediction
    ("parallel.train.checks", "parallel.train.persist"),  # before the first step | what a run keeps
    ("parallel.train.observe",),                # what a run tells and keeps as it goes: its observers
    ("parallel.train",),                        # the loop, the step and the job's start and end
    ("parallel.train.cli",),                    # Hydra's command line
    ("parallel.bench",),                        # measurements of this machine
)
"""The layers of ``parallel/``: a module belongs to the longest name it starts with."""


def layer_of(module: str) -> tuple[int, str]:
    """(row in ``LAYERS``, the folder) of a module of ``parallel``: a module directly in
    ``parallel/`` that no row names (``python -m parallel.selfcheck``) is the public API's."""
    best = max((name for row in LAYERS for name in row if module == name or module.startswith(name + ".")),
               key=len, default=None)
    if best is None:
        raise KeyError(f"{module} belongs to no layer of LAYERS")
    return next(i for i, row in enumerate(LAYERS) if best in row), best


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module in a layer above the importer's, or in a sibling folder of
    the same row (siblings stay independent of each other)."""
    found = []
    for mod, targets in sorted(graph.items()):
        row, folder = layer_of(mod)
        for t in sorted(targets):
            t_row, t_folder = layer_of(t)
            if t_row > row or (t_row == row and t_folder != folder):
                found.append(f"{mod} ({folder}) imports {t} ({t_folder})")
    return found


def test_every_module_has_a_layer_and_imports_only_below():
    graph = import_graph()
    assert len(graph) > 100
    for mod in graph:
        layer_of(mod)  # KeyError for a module outside every layer
    assert not upward_imports(graph), "\n".join(upward_imports(graph))


def test_the_layering_audit_sees_an_upward_import(tmp_path):
    pkg = tmp_path / "parallel"
    for folder in ("layers", "train", "comm"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "comm" / "ops.py").write_text("")
    (pkg / "train" / "loop.py").write_text("from parallel.layers import conv\n")
    (pkg / "layers" / "conv.py").write_text("def f():\n    from parallel.train.loop import x\n"
                                            "from parallel.comm import ops\n")
    found = upward_imports(import_graph(tmp_path))
    assert found == ["parallel.layers.conv (parallel.layers) imports parallel.train.loop (parallel.train)"]


def _imported_from(path: Path, package: str) -> set[str]:
    """Names a module imports from ``package`` or any of its submodules."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module == package:
            found.update(f"{node.module}:{a.name}" for a in node.names)
    return found


def _calls_on(func: ast.AST, name: str) -> list[str]:
    """``name.<method>(...)`` calls in ``func``, in source order."""
    calls = [n for n in ast.walk(func) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and isinstance(n.func.value, ast.Name) and n.func.value.id == name]
    return [c.func.attr for c in sorted(calls, key=lambda c: (c.lineno, c.col_offset))]  # type: ignore[attr-defined]


def _function(path: Path, name: str) -> ast.AST:
    return next(n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                if isinstance(n, ast.FunctionDef) and n.name == name)


def _called(func: ast.AST) -> list[str]:
    """The names a function calls (``f(...)``, ``x.f(...)``), in source order."""
    calls = [n for n in ast.walk(func) if isinstance(n, ast.Call)]
    names = [getattr(c.func, "id", getattr(c.func, "attr", "")) for c in sorted(
        calls, key=lambda c: (c.lineno, c.col_offset))]
    return [n for n in names if n]


def _in_order(names: list[str], wanted: list[str]) -> bool:
    it = iter(names)
    return all(w in it for w in wanted)


def test_the_start_up_path_goes_down_in_plain_calls():
    """``train()`` and the job it builds read top to bottom: the checks without a process
    group, the grid, the run directory, the job; on the grid the files and cases, then the
    model built, converted and checked against serial in plain calls (no callable builds it
    inside a check), then the loop, which gets built parts."""
    train_dir = REPO / "parallel" / "train"
    train = _called(_function(train_dir / "lifecycle.py", "train"))
    assert _in_order(train, ["_before_grid", "_start_grid", "_settle_run_dir", "regrid", "_start_watchdog",
                             "run_job"]), train
    build = _called(_function(train_dir / "job.py", "build_job"))
    assert _in_order(build, ["on_grid", "start", "_read_resume", "save_config", "build_data", "_build_model",
                             "_optimizer", "TrainState", "load_state_dict", "TrainStep", "Observers", "Loop"]), build
    model = _called(_function(train_dir / "job.py", "_build_model"))
    assert _in_order(model, ["build_model", "serial_copy", "parallelize", "run", "compile_model"]), model
    tree = ast.parse((train_dir / "job.py").read_text(encoding="utf-8"))
    lambdas_into_checks = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") in
                           ("run", "serial_copy", "on_grid") and any(isinstance(a, ast.Lambda) for a in n.args)]
    assert not lambdas_into_checks


def test_the_loop_gets_built_parts_and_stays_short():
    """The loop never sees the job config or the checks, decides the run's end in one place
    (``Ending``), and ``fit`` with the methods it runs fits on one screen."""
    loop = REPO / "parallel" / "train" / "loop.py"
    imported = {name.split(":")[0] for name in _imported_from(loop, "parallel.job.config")} | \
        _imported_from(loop, "parallel.train.checks")
    assert not imported, imported
    tree = ast.parse(loop.read_text(encoding="utf-8"))
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Loop")
    methods = {n.name: n.end_lineno - n.lineno + 1 for n in cls.body if isinstance(n, ast.FunctionDef)}  # type: ignore
    running = sum(v for k, v in methods.items() if k != "__init__")
    assert {"fit", "_epoch", "_step", "_evaluate"} <= methods.keys() and running < 60, methods
    assert "status" not in loop.read_text(encoding="utf-8")  # why a run ends: Ending.why alone


ALLOWED_WHOLE_JOB = {
    # functions that take the whole job config, and why: each checks, plans or records the job as a whole
    "parallel.train.lifecycle": {"train", "_before_grid", "_start_grid"},  # the entry: hands sections down
    "parallel.train.job": {"run_job", "build_job", "_build_model", "_optimizer"},  # the assembly
    "parallel.train.checks": {"before_grid", "on_grid"},  # the checks of the whole job
    "parallel.train.checks.config": {"validate_config", "_validate_crop_and_eval", "_validate_kfac"},
    "parallel.train.checks.fit": {"check_cases", "_sliding"},  # crops, windows and cases across sections
    "parallel.train.checks.autosplit": {"job_plan", "auto_spatial"},  # the planner predicts the whole job
    "parallel.train.checks.budget": {"start", "_decide"},  # ... and so its memory
    "parallel.train.observe.mlperf": {"log_submission", "log_segmentation"},  # the job's hyperparameters
}


def test_modules_take_the_config_section_they_use():
    """Only the functions in ``ALLOWED_WHOLE_JOB`` take the job config (``JobConfig``); the
    others take the section they use (``cfg.train``, ``cfg.run``, ``cfg.data`` ...)."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / "parallel").rglob("*.py")):
        mod = _module_name(path, REPO)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                if any(a.annotation is not None and "JobConfig" in ast.unparse(a.annotation) for a in args):
                    found.setdefault(mod, set()).add(node.name)
    assert found == ALLOWED_WHOLE_JOB


def test_the_train_package_map_names_every_module():
    import parallel.train

    train = REPO / "parallel" / "train"
    modules = {p.stem for p in train.glob("*.py") if p.name != "__init__.py"}
    modules |= {p.name for p in train.iterdir() if (p / "__init__.py").is_file()}
    assert {"checks", "lifecycle", "persist"} <= modules
    doc = parallel.train.__doc__ or ""
    assert not sorted(m for m in modules if f"``{m}``" not in doc)
