"""The model card (metadata Hugging Face parses, evidence, limits), the data card, and where
promotion writes them: into the exported version and onto the registry version."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from lmops.pipeline.data import get_data, split
from lmops.pipeline.model_card import (
    DESCRIPTION_LIMIT,
    EVIDENCE_TAG,
    MODEL_CARD_FILE,
    data_card,
    mlflow_description,
    model_card,
    read_evidence,
)
from lmops.pipeline.params import DataConfig, MlflowConfig, PromoteConfig, SplitConfig
from lmops.runtime.model_dir import CURRENT, ModelMeta, export, read_meta
from tests.conftest import make_tiny_model_dir

SHA = "ab" * 32
META = ModelMeta(
    run_id="run-1",
    data_sha256=SHA,
    num_params=12345,
    model_name="lmops",
    model_version=3,
    metrics={
        "val_loss": 2.5,
        "test_bits_per_byte": 1.25,
        "test_loss": 2.0,
        "test_split_sha256": "cd" * 32,
    },
)
PARAMS = {
    "model.dim": "64",
    "model.n_layers": "2",
    "train.max_steps": "20",
    "device": "cpu",
    "data.source": "x",
}
CHECKS = [
    {"name": "greedy_deterministic", "passed": True, "message": "same text twice"},
    {"name": "code_compiles", "passed": False, "message": "2 of 3 samples | do not parse"},
]
PROMOTED = {
    "promoted": True,
    "reason": "the interval lies below -0.02",
    "rule": "paired bootstrap",
    "candidate_bits_per_byte": 1.25,
    "champion_bits_per_byte": 1.31,
    "delta_bits_per_byte": -0.06,
    "interval": [-0.08, -0.04],
    "units": 40,
    "confidence": 0.95,
    "min_improvement": 0.02,
    "champion_version": 2,
    "checks": CHECKS[:1],
    "latency": {"ratio": 1.1, "candidate_s": 0.5},
}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """What the real split reports on a tiny corpus."""
    tmp = tmp_path_factory.mktemp("split")
    (tmp / "c.jsonl").write_text(
        "".join(
            json.dumps({"text": t}) + "\n" for t in ["a" * 10, "", "a" * 10, "b" * 30, "c" * 50, "d" * 40]
        )
    )
    get_data(DataConfig(source=str(tmp / "c.jsonl")), tmp / "raw")
    cwd = os.getcwd()
    os.chdir(tmp)  # split notes its throughput in artifacts/ of the working directory
    try:
        return split(
            SplitConfig(method="tail", val_fraction=0.25, test_fraction=0.25), 1, tmp / "raw", tmp / "out"
        )
    finally:
        os.chdir(cwd)


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("\n---\n", 1)[0].removeprefix("---\n"))


def test_the_metadata_is_hugging_faces_with_the_test_metrics_and_the_corpus_digest(report):
    card = model_card(META, PARAMS, PROMOTED, report)
    meta = front_matter(card)
    assert meta["datasets"] == [f"sha256:{SHA}"] and meta["library_name"] == "transformers"
    (result,) = meta["model-index"][0]["results"]
    assert result["task"] == {"type": "text-generation"}
    assert result["dataset"]["revision"] == SHA and result["dataset"]["name"] == report["source"]
    assert {m["type"]: m["value"] for m in result["metrics"]} == {"bits_per_byte": 1.25, "loss": 2.0}
    hub = pytest.importorskip("huggingface_hub")
    data = hub.ModelCard(card).data  # raises on a model-index it cannot read
    assert data.model_name == "lmops" and data.datasets == [f"sha256:{SHA}"]
    assert {(r.metric_type, r.metric_value, r.dataset_revision) for r in data.eval_results} == {
        ("bits_per_byte", 1.25, SHA),
        ("loss", 2.0, SHA),
    }


def test_the_card_renders_the_model_data_params_and_limits(report):
    card = model_card(META, PARAMS, PROMOTED, report)
    assert card.count("\n# lmops v3\n") == 1 and "12,345 parameters" in card
    assert "| dim | 64 |" in card and "| max_steps | 20 |" in card and "| device | cpu |" in card
    assert (
        "source" not in card.split("## Training params")[1].split("## Evaluation")[0]
    )  # data.* is the data's
    assert f"- sha256: `{SHA}`" in card and f"- documents: {report['documents']}" in card
    for name, s in report["split"].items():
        if isinstance(s, dict):
            assert f"| {name} | {s['documents']} | {s['bytes']} |" in card
    assert "| bits_per_byte | 1.25 |" in card and "cd" * 32 in card and "| val_loss | 2.5 |" in card
    assert "Not instruction-tuned" in card and "No safety tuning" in card


def test_the_evidence_of_a_promotion_and_of_a_refusal(report):
    promoted = model_card(META, PARAMS, PROMOTED, report).split("## Promotion evidence")[1]
    assert "**Promoted**: the interval lies below -0.02" in promoted
    assert "| interval | [-0.08, -0.04] |" in promoted and "| champion_version | 2 |" in promoted
    assert (
        "| name | passed | message |" in promoted
        and "| greedy_deterministic | yes | same text twice |" in promoted
    )
    assert "| ratio | 1.1 |" in promoted
    refused = {**PROMOTED, "promoted": False, "reason": "failed checks: code_compiles", "checks": CHECKS}
    text = model_card(META, PARAMS, refused, report).split("## Promotion evidence")[1]
    assert "**Not promoted**: failed checks: code_compiles" in text
    assert "| code_compiles | no | 2 of 3 samples \\| do not parse |" in text  # a | in a cell stays in it
    assert "| other | thing |" in model_card(META, {}, {"other": "thing"}, None)  # keys it does not know


def test_a_card_without_evidence_report_or_metrics_still_renders():
    card = model_card(ModelMeta(), {}, None, None)
    assert front_matter(card)["model-index"][0]["name"] == "lmops"
    assert "None recorded" in card and "logged no data report" in card and "No test metrics" in card
    hub = pytest.importorskip("huggingface_hub")
    assert hub.ModelCard(card).data.eval_results == []


def test_the_evidence_tag_is_read_when_it_parses():
    assert read_evidence({EVIDENCE_TAG: json.dumps(PROMOTED)}) == PROMOTED
    assert read_evidence({}) is None
    assert read_evidence({EVIDENCE_TAG: json.dumps(PROMOTED)[:50]}) is None  # cut at the tag limit


def test_the_description_is_the_card_without_metadata_within_mlflows_limit(report):
    card = model_card(META, PARAMS, PROMOTED, report)
    assert mlflow_description(card) == card.split("\n---\n", 1)[1].lstrip()
    assert mlflow_description(card).startswith("# lmops v3")
    long = mlflow_description(model_card(META, {f"train.k{i}": "v" * 50 for i in range(200)}, None, None))
    assert len(long) == DESCRIPTION_LIMIT and long.endswith(f"the exported model's {MODEL_CARD_FILE})\n")


def test_the_data_card_lists_every_split(report):
    card = data_card(report)
    assert f"| sha256 | {report['sha256']} |" in card and f"| documents | {report['documents']} |" in card
    assert f"| exact duplicates merged | {report['duplicates_merged']} |" in card
    for name in ("train", "val", "test"):
        s = report["split"][name]
        assert f"| {name} | {s['documents']} | {s['bytes']} |" in card
    assert "method `tail`" in card and "| min | p10 | p50 |" in card
    assert "None." in card.split("## Warnings")[1]
    seeded = data_card(
        {**report, "split": {**report["split"], "method": "random", "seed": 7}, "capped_at_max_bytes": True}
    )
    assert "method `random`, seed 7" in seeded and "cut at data.max_bytes" in seeded


def test_split_writes_the_data_card_beside_the_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.txt").write_text("".join(f"paragraph {i}\n\n" for i in range(30)))
    get_data(DataConfig(source=str(tmp_path / "c.txt")), tmp_path / "raw")
    report = split(SplitConfig(), 1, tmp_path / "raw", tmp_path / "out", tmp_path / "r" / "data_report.json")
    assert (tmp_path / "r" / "data_card.md").read_text() == data_card(report)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("model"), meta={"run_id": "run-1", "data_sha256": SHA})


def test_export_writes_the_card_into_the_version_before_the_flip(model_dir, tmp_path):
    served = tmp_path / "served"
    export(model_dir, served, extra_files={MODEL_CARD_FILE: "# card v1\n"}, model_version=1)
    version = served / os.readlink(served / CURRENT)
    assert (version / MODEL_CARD_FILE).read_text() == "# card v1\n"
    assert os.readlink(served / MODEL_CARD_FILE) == f"{CURRENT}/{MODEL_CARD_FILE}"
    assert (version / MODEL_CARD_FILE).stat().st_mode & 0o044 == 0o044  # readable by others (umask 022)
    export(model_dir, served, extra_files={MODEL_CARD_FILE: "# card v2\n"}, model_version=2)
    assert (served / MODEL_CARD_FILE).read_text() == "# card v2\n"


def test_reconcile_exports_the_card_and_sets_it_as_the_registry_description(
    model_dir, tmp_path, monkeypatch, report
):
    """The real path through a sqlite MLflow: the champion's params, logged data report and
    evidence tag make the card in README.md and in the model version's description."""
    import mlflow.tracking._tracking_service.utils as tracking_state

    from lmops.pipeline import tracking
    from lmops.pipeline.promote import reconcile
    from lmops.runtime.model_dir import write_meta

    # configure() sets MLflow's process-wide URI, which outranks MLFLOW_TRACKING_URI: put it
    # back after this test, or later tests in this worker would write to this store.
    monkeypatch.setattr(tracking_state, "_tracking_uri", tracking_state._tracking_uri)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    experiment = tracking.configure(MlflowConfig(artifact_location=str(tmp_path / "mlruns")))
    client = tracking.client()
    run_id = client.create_run(experiment).info.run_id
    client.log_param(run_id, "model.dim", "64")
    client.log_dict(run_id, report, "data_report.json")
    client.create_registered_model("lmops")
    version = client.create_model_version("lmops", source=str(model_dir), run_id=run_id).version
    client.set_model_version_tag("lmops", version, EVIDENCE_TAG, json.dumps(PROMOTED))
    client.set_model_version_tag("lmops", version, "test_bits_per_byte", "1.25")
    client.set_registered_model_alias("lmops", "champion", version)
    local = Path(tmp_path / "model")
    local.mkdir()
    for f in model_dir.iterdir():
        (local / f.name).write_bytes(f.read_bytes())
    write_meta(
        local, read_meta(model_dir).model_copy(update={"run_id": run_id})
    )  # the champion's run: no download

    reconcile(PromoteConfig(export_dir=str(tmp_path / "served")), local)
    card = (tmp_path / "served" / MODEL_CARD_FILE).read_text()
    assert "# lmops v1" in card and "| dim | 64 |" in card and "**Promoted**" in card
    assert f"| {report['split']['test']['bytes']} |" in card  # from the run's data report
    assert {m["type"]: m["value"] for m in front_matter(card)["model-index"][0]["results"][0]["metrics"]} == {
        "bits_per_byte": 1.25
    }
    assert client.get_model_version("lmops", version).description == mlflow_description(card)
