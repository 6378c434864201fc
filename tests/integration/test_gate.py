"""The promotion gate through `lmops promote` on real models, tracking and registry: a
better but slower candidate is refused under promote.max_latency_ratio and promoted
without it; a failing check blocks with its name; a check that does not import stops
with one line and promotes nothing; a champion that cannot be downloaded stops promote
with one line, and --force promotes and records why there was no evidence."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from tests.conftest import BIN, REPO, TINY_PARAMS, run, write_params
from tests.integration.test_cli import assert_clean_error

pytestmark = pytest.mark.slow


# A user's own check, in the project directory, as promote.checks names one ("module:function").
USER_CHECKS = """from lmops.pipeline.checks import CheckResult


def refuse_everything(candidate, champion, ctx):
    return CheckResult("refuse_everything", False, "this model is never good enough", {"answer": 42})
"""


def stages(project, *names: str):
    for name in names:
        run([str(BIN / "lmops"), name], project)


def promotion(project) -> dict:
    return json.loads((project / "artifacts/promotion.json").read_text())


@pytest.fixture(scope="module")
def project(tokenized_project, tmp_path_factory):
    """A champion trained 10 steps, and a candidate of its shape trained 24: better. It is
    served slower where a test says so (tests/slow_candidate.py)."""
    project = tmp_path_factory.mktemp("gate") / "repo"
    shutil.copytree(tokenized_project, project)
    write_params(
        project,
        {"train": {"max_steps": 10}},
        base=project / "params.yaml",  # the tiny project's (uncompiled training, 64-token context)
    )
    stages(project, "train", "evaluate", "promote")
    assert promotion(project)["promoted"] and promotion(project)["reason"] == "no champion yet"
    write_params(
        project,
        {"train": {"max_steps": 24}, "promote": {"max_latency_ratio": 1.2}},
        base=project / "params.yaml",
    )
    stages(project, "train", "evaluate")
    return project


def test_a_failing_check_blocks_with_its_name_and_a_broken_one_stops_cleanly(project):
    (project / "my_checks.py").write_text(USER_CHECKS)
    checks = ["greedy_deterministic", "my_checks:refuse_everything"]
    write_params(project, {"promote": {"checks": checks}}, base=project / "params.yaml")
    run([str(BIN / "lmops"), "promote"], project)
    blocked = promotion(project)
    assert not blocked["promoted"] and "failed checks: my_checks:refuse_everything" in (blocked["reason"])
    assert "(this model is never good enough)" in blocked["reason"]
    [user] = [c for c in blocked["evidence"]["checks"] if c["name"].endswith("refuse_everything")]
    assert user["numbers"] == {"answer": 42} and not user["passed"]

    write_params(project, {"promote": {"checks": ["no_such_module:fn"]}}, base=project / "params.yaml")
    assert_clean_error(run([str(BIN / "lmops"), "promote"], project, check=False), "no_such_module:fn")
    assert promotion(project) == blocked  # nothing written
    write_params(project, {"promote": TINY_PARAMS["promote"]}, base=project / "params.yaml")


def test_a_better_but_slower_candidate_waits_for_the_latency_budget(project):
    run([sys.executable, str(REPO / "tests/slow_candidate.py"), "promote"], project)
    refused = promotion(project)
    evidence = refused["evidence"]
    assert not refused["promoted"] and "exceeds max_latency_ratio 1.2" in refused["reason"]
    assert evidence["delta_bits_per_byte"] < evidence["interval"][1] < -evidence["min_improvement"]
    assert evidence["latency"]["ratio"] > 1.2 and evidence["units"] > 1
    assert all(c["passed"] for c in evidence["checks"])
    numbers = json.loads((project / "artifacts/promotion_metrics.json").read_text())
    assert numbers["promoted"] == 0 and numbers["latency_ratio"] == evidence["latency"]["ratio"]

    write_params(project, {"promote": {"max_latency_ratio": None}}, base=project / "params.yaml")
    run([str(BIN / "lmops"), "promote"], project)
    promoted = promotion(project)
    assert promoted["promoted"] and promoted["version"] == refused["version"]  # the same version
    assert "below -0.02" in promoted["reason"] and "measured on the same test units" in promoted["reason"]
    card = (project / "production_service/model/README.md").read_text()
    assert card.startswith("---\n") and "model-index" in card and str(promoted["evidence"]["units"]) in card


def test_a_champion_that_cannot_be_downloaded_stops_promote_and_force_says_why(project):
    """After the test above v2 is @champion: a new candidate, and v2's logged weights gone."""
    champion = promotion(project)
    assert champion["promoted"] and champion["version"] == 2
    write_params(project, {"train": {"max_steps": 4}}, base=project / "params.yaml")
    stages(project, "train", "evaluate")
    logged = [
        meta.parent / "model.safetensors"
        for meta in (project / "artifacts/mlruns").rglob("lmops.json")
        if json.loads(meta.read_text()).get("run_id") == champion["run_id"]
    ]
    assert logged
    for weights in logged:
        weights.unlink()

    refused = run([str(BIN / "lmops"), "promote"], project, check=False)
    assert_clean_error(
        refused, "the champion v2 cannot be downloaded: models:/lmops/2 holds no model directory"
    )
    assert promotion(project) == champion  # nothing written

    run([str(BIN / "lmops"), "promote", "--force"], project)
    forced = promotion(project)
    assert forced["promoted"] and forced["version"] == 3
    assert forced["reason"].startswith(
        "forced with --force (the gate said: the champion v2 cannot be downloaded"
    )
    assert json.loads((project / "production_service/model/lmops.json").read_text())["model_version"] == 3
