"""Two halves, one direction (docs/architecture.md): the runtime (lmops.runtime) and the service
(production_service) never import the pipeline (lmops.pipeline), not even lazily, so the
serving image carries neither its code nor its dependencies; and the service's settings,
which gunicorn's master reads, load no torch."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

RUNTIME_DIRS = (REPO / "src" / "lmops" / "runtime", REPO / "production_service")
SHARED = ("lmops", "lmops.errors", "lmops.atomic", "lmops.crash_points", "lmops.prometheus")
# Third-party packages the serving image does not have (requirements-serve.lock).
PIPELINE_ONLY = ("dvc", "pandas", "transformers", "pyarrow", "fsspec")
# Imported by the runtime only inside the function that needs it (registry downloads, the pyfunc).
LAZY_ONLY = ("mlflow",)


def imports_of(path) -> list[tuple[str, bool]]:
    """(module, at top level?) for every import statement in a file, those inside functions too."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        found += [(n, node.col_offset == 0) for n in names]
    return found


def runtime_files():
    return sorted(p for d in RUNTIME_DIRS for p in d.rglob("*.py"))


def test_the_layers_are_where_the_layout_says():
    names = {p.name for p in (REPO / "src" / "lmops").iterdir()}
    assert {"runtime", "pipeline"} <= names
    top = {p.stem for p in (REPO / "src" / "lmops").glob("*.py")} - {"__init__"}
    assert {f"lmops.{m}" for m in top} <= set(SHARED), "shared modules stay leaves"


@pytest.mark.parametrize("path", runtime_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_runtime_file_imports_the_pipeline(path):
    bad = []
    for module, top_level in imports_of(path):
        root = module.split(".")[0]
        if (
            module == "lmops.pipeline"
            or module.startswith("lmops.pipeline.")
            or root in PIPELINE_ONLY
            or (root in LAZY_ONLY and top_level and path.name != "mlflow_pyfunc.py")
        ):
            bad.append(module)
    assert not bad, f"{path.relative_to(REPO)} imports {sorted(set(bad))}"


def test_shared_modules_import_neither_half():
    for module in SHARED[1:]:
        path = REPO / "src" / (module.replace(".", "/") + ".py")
        crossed = [m for m, _ in imports_of(path) if m.startswith(("lmops.runtime", "lmops.pipeline"))]
        assert not crossed, f"{module} imports {crossed}"


def loaded_by(module: str) -> list[str]:
    probe = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize(
    "module",
    ["lmops.runtime.model", "lmops.runtime.engine.loop", "lmops.runtime.model_dir", "production_service.app"],
)
def test_importing_the_runtime_loads_no_pipeline(module):
    loaded = loaded_by(module)
    crossed = [
        m for m in loaded if m.startswith("lmops.pipeline") or m.split(".")[0] in PIPELINE_ONLY + LAZY_ONLY
    ]
    assert not crossed, f"importing {module} loads {crossed}"


def test_the_service_settings_load_no_torch():
    """gunicorn's master reads them (gunicorn.conf.py): torch stays in the worker."""
    loaded = loaded_by("production_service.settings")
    assert "production_service.settings" in loaded and "torch" not in loaded


def module_name(path) -> str:
    rel = path.relative_to(REPO / "src" if path.is_relative_to(REPO / "src") else REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def lazy_names(path) -> dict[str, str]:
    """A package's `_MODULES` table (name -> submodule), which its `__getattr__` imports from
    on first use: `from package import Name` imports that submodule."""
    if path.name != "__init__.py":
        return {}
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["_MODULES"]:
            return ast.literal_eval(node.value)
    return {}


def internal_imports(path, modules: set[str], lazy: dict[str, dict[str, str]]) -> set[str]:
    """The project modules a file imports, lazily (inside functions) too, through a package's
    lazy names too; an import under `if TYPE_CHECKING:` is left out: it never runs."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    skipped = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], base]
                ).strip(".")
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    found.add(f"{base}.{alias.name}")
                elif alias.name in lazy.get(base, {}):
                    found.add(f"{base}.{lazy[base][alias.name]}")
                else:
                    found.add(base)
    return found & modules


def import_graph() -> dict[str, set[str]]:
    files = sorted(p for d in (REPO / "src" / "lmops", REPO / "production_service") for p in d.rglob("*.py"))
    modules = {module_name(p) for p in files}
    lazy = {module_name(p): lazy_names(p) for p in files}
    return {module_name(p): internal_imports(p, modules, lazy) - {module_name(p)} for p in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_lazy_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_lazy_imports_included():
    """One direction between any two modules: a function-level import that closes a loop is
    still a cycle (only a `TYPE_CHECKING` import, which never runs, is not)."""
    graph = import_graph()
    assert graph["lmops.runtime.engine.engine"] and "lmops.runtime.model_dir" in graph  # it read them
    # `from lmops.runtime.engine import SamplingParams` reaches sampling.py (the package's lazy names)
    assert "lmops.runtime.engine.sampling" in graph["lmops.runtime.mlflow_pyfunc"]
    assert cycles(graph) == []
