"""Two halves, one direction (DESIGN.md): the runtime (lmops.runtime) and the service
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
SHARED = ("lmops", "lmops.errors", "lmops.atomic", "lmops.crash_points")
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
