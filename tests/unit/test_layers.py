"""The runtime (model, tokenizer, engine, the service) never imports the pipeline: the
serving image carries neither its code nor its dependencies (DESIGN.md, "Two halves,
one direction")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

# The subprocess runs in the repository root, where production_service imports.
# lmops.engine loads its modules lazily: the loop imports every one of them.
RUNTIME = ["lmops.model", "lmops.tokenizer", "lmops.engine.loop", "production_service.app"]
PIPELINE = [
    "lmops.cli",
    "lmops.config",
    "lmops.paths",
    "lmops.data",
    "lmops.sources",
    "lmops.tokenize",
    "lmops.random_model",
    "lmops.train",
    "lmops.evaluate",
    "lmops.promote",
    "lmops.tracking",
    "mlflow",
    "dvc",
    "pandas",
    "transformers",
]


@pytest.mark.parametrize("module", RUNTIME)
def test_runtime_imports_no_pipeline_code(module):
    probe = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(
        subprocess.run([sys.executable, "-c", probe], capture_output=True, check=True, cwd=REPO).stdout
    )
    assert module in loaded
    crossed = [m for m in loaded if m in PIPELINE or m.startswith(tuple(p + "." for p in PIPELINE))]
    assert not crossed, f"importing {module} loads pipeline modules: {crossed}"
