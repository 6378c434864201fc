"""The slice rule through the real stages: a candidate better on the whole test split but
trained without one directory's documents is refused by promote.max_slice_regression, and
the report names that directory; without the rule the same version is promoted."""

from __future__ import annotations

import csv
import json
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import BIN, TINY_PARAMS, make_project, run, write_params
from tests.integration.test_cli import assert_clean_error

pytestmark = pytest.mark.slow

# The second slice: Python source with two letters spelled in Greek, bytes a model trained
# on the first slice alone has never seen (every other byte of it, it has).
GREEK = str.maketrans("eo", "εο")


def stages(project: Path, *names: str) -> None:
    for name in names:
        run([str(BIN / "lmops"), name], project)


def promotion(project: Path) -> dict:
    return json.loads((project / "artifacts/promotion.json").read_text())


def write_corpus(root: Path, code_bytes: int, greek_bytes: int) -> None:
    """corpus/code/*.py and corpus/greek/*.py from the standard library's top-level modules,
    about `*_bytes` of each (the last file of each cut at a line)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    for name, budget, translate in (("code", code_bytes, False), ("greek", greek_bytes, True)):
        (root / name).mkdir(parents=True)
        while budget > 0:
            path = files.pop(0)
            text = path.read_text(encoding="utf-8")
            text = text.translate(GREEK) if translate else text
            data = text.encode()[:budget]
            text = data[: data.rfind(b"\n") + 1].decode()
            (root / name / path.name).write_text(text, encoding="utf-8")
            budget -= len(data)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A champion trained 10 steps on both directories, and a candidate trained 100 steps on
    the same split with the Greek documents cut out of its training text."""
    root = tmp_path_factory.mktemp("slices")
    write_corpus(root / "corpus", 240_000, 24_000)
    project = make_project(
        root / "repo",
        {
            "data": {"source": str(root / "corpus"), "document_unit": "chunk", "chunk_bytes": 256},
            "split": {"val_fraction": 0.1, "test_fraction": 0.2},
            "evaluate": {**TINY_PARAMS["evaluate"], "unit_bytes": 128},
            "promote": {**TINY_PARAMS["promote"], "slice_by": "directory", "min_slice_units": 5},
            "train": {**TINY_PARAMS["train"], "max_steps": 10},
        },
        git=False,
    )
    stages(project, "get_data", "split", "tokenize", "train", "evaluate", "promote")
    assert promotion(project)["promoted"]

    train = project / "data/processed/train.txt"
    text = train.read_text(encoding="utf-8")
    first_greek = text.index("ε")  # code/ sorts first
    train.write_text(text[: text.rfind("\n", 0, first_greek) + 1], encoding="utf-8")
    write_params(project, {"train": {"max_steps": 100}}, base=project / "params.yaml")
    stages(project, "tokenize", "train", "evaluate")
    return project


def test_unit_results_that_are_not_the_metrics_ones_stop_promote(project):
    """What a kill between evaluate's writes of units.csv and metrics.json leaves."""
    units = project / "artifacts/eval/units.csv"
    kept = units.read_text()
    units.write_text(kept.rsplit("\n", 2)[0] + "\n")  # one unit short
    refused = run([str(BIN / "lmops"), "promote"], project, check=False)
    assert_clean_error(refused, "units.csv is not the one artifacts/metrics.json was measured with")
    units.write_text(kept)


def test_a_candidate_worse_on_one_slice_is_refused_and_the_slice_named(project):
    run([str(BIN / "lmops"), "promote"], project)
    refused = promotion(project)
    evidence = refused["evidence"]
    assert not refused["promoted"], refused["reason"]
    assert evidence["interval"][1] < -evidence["min_improvement"]  # better on the whole split
    assert evidence["worst_slice"].endswith("/greek") and evidence["slice_by"] == "directory"
    assert "1 slice(s) worse beyond +0.05, the worst '" in refused["reason"]
    assert "/greek'" in refused["reason"]
    by_name = {Path(s["slice"]).name: s for s in evidence["slices"]}
    assert set(by_name) == {"code", "greek"}
    assert by_name["greek"]["regressed"] and by_name["greek"]["interval"][0] > 0.05
    assert not by_name["code"]["regressed"] and by_name["code"]["delta_bits_per_byte"] < 0
    assert sum(s["units"] for s in evidence["slices"]) == evidence["units"]
    numbers = json.loads((project / "artifacts/promotion_metrics.json").read_text())
    assert numbers["slices_regressed"] == 1 and numbers["worst_slice_delta"] > 0.05

    with open(project / "artifacts/promotion_slices.csv", newline="") as fh:
        rows = {Path(r["slice"]).name: r for r in csv.DictReader(fh)}
    assert float(rows["greek"]["candidate"]) > float(rows["greek"]["champion"])
    assert float(rows["code"]["candidate"]) < float(rows["code"]["champion"])

    write_params(project, {"promote": {"max_slice_regression": 100.0}}, base=project / "params.yaml")
    run([str(BIN / "lmops"), "promote"], project)
    promoted = promotion(project)
    assert promoted["promoted"] and promoted["version"] == refused["version"], promoted["reason"]
    assert "worst slice '" in promoted["reason"]
