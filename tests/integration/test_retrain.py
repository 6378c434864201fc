"""Continuous training for real: `deploy/dvc.sh refresh repro`, what a retraining
Jenkins build runs (less pull and push), with real DVC and MLflow on a project
whose data source is a local file. An unchanged source is fetched again but trains
nothing and marks nothing to release; a changed one trains, and only a promotion
marks a release (reports/new-champion, which the Jenkinsfile's release stages wait for)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO, make_project, run

pytestmark = pytest.mark.slow

MARKER = "reports/new-champion"


def corpus_text(size: int) -> str:
    """The first `size` characters of the standard library's Python source, whole lines."""
    text = "".join(
        f.read_text(errors="replace") for f in sorted(Path(json.__file__).parent.parent.glob("*.py"))[:40]
    )
    return text[: text.index("\n", size) + 1]


def retrain(project: Path) -> tuple[list[str], str | None]:
    """The stages dvc ran, and the release marker (None when there is none)."""
    proc = run([str(project / "deploy" / "dvc.sh"), "refresh", "repro"], project)
    ran = [line.split("'")[1] for line in proc.stdout.splitlines() if line.startswith("Running stage")]
    marker = project / MARKER
    return ran, marker.read_text() if marker.exists() else None


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("retrain")
    source = root / "corpus.txt"
    source.write_text(corpus_text(150_000))
    project = make_project(root / "repo", {"data": {"source": str(source), "max_bytes": 400_000}})
    shutil.copytree(REPO / "deploy", project / "deploy", ignore=shutil.ignore_patterns("__pycache__"))
    return project, source


def test_the_first_run_trains_and_marks_the_first_champion(project):
    project, _ = project
    ran, marker = retrain(project)
    assert ran == ["get_data", "split", "tokenize", "train", "evaluate", "promote"]
    assert marker is not None and json.loads(marker)["promoted"] is True


def test_an_unchanged_source_trains_nothing_and_releases_nothing(project):
    project, _ = project
    ran, marker = retrain(project)
    assert ran == ["get_data"]  # fetched again (forced); same corpus, so nothing downstream
    assert marker is None


def test_a_changed_source_trains_and_only_a_promotion_marks_a_release(project):
    project, source = project
    source.write_text(corpus_text(250_000))  # new data: more of it
    ran, marker = retrain(project)
    assert ran[:4] == ["get_data", "split", "tokenize", "train"] and "promote" in ran
    promotion = json.loads((project / "artifacts" / "promotion.json").read_text())
    assert (marker is not None) == promotion["promoted"]
    assert promotion["champion_trained_on_other_data"] is True  # and promote says so if it replaces it
    if marker is not None:
        assert json.loads(marker) == promotion
