"""Lineage in MLflow: the splits a training read are its run's dataset inputs, the logged
model's metrics name them, and a registered version leads back to them."""

from __future__ import annotations

import hashlib
import json
import signal

import pytest

from lmops.crash_points import ENV as CRASH_AT
from lmops.pipeline import tracking
from tests.conftest import BIN, env, run
from tests.integration.training import copy_project

pytestmark = pytest.mark.slow


def test_splits_are_the_runs_inputs_and_the_models_datasets(tokenized_project, tmp_path, monkeypatch):
    project = copy_project(tokenized_project, tmp_path / "p")
    crash = run([str(BIN / "lmops"), "train"], project, check=False, env={**env(), CRASH_AT: "train.step:15"})
    assert crash.returncode == -signal.SIGKILL
    run([str(BIN / "lmops"), "train"], project)  # resumes into the same MLflow run: no second inputs

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project}/mlflow.db")
    client = tracking.client()
    run_id = json.loads((project / "artifacts/model/lmops.json").read_text())["run_id"]
    mlrun = client.get_run(run_id)
    inputs = {
        {t.key: t.value for t in i.tags}["mlflow.data.context"]: i.dataset
        for i in mlrun.inputs.dataset_inputs
    }
    assert len(mlrun.inputs.dataset_inputs) == 3
    report = json.loads((project / "artifacts/data_report.json").read_text())
    for split, context in (("train", "training"), ("val", "validation"), ("test", "testing")):
        data = (project / f"data/processed/{split}.txt").read_bytes()
        sha256 = hashlib.sha256(data).hexdigest()
        dataset = inputs[context]
        assert (dataset.name, dataset.digest) == (f"python-stdlib-{split}", sha256[:36])
        assert dataset.source_type == "code" and "python-stdlib" in dataset.source
        profile = json.loads(dataset.profile)
        assert profile == {
            "sha256": sha256,
            "bytes": len(data),
            "documents": report["split"][split]["documents"],
        }

    # The registered version -> its logged model -> the splits its metrics were measured on,
    # and the run that produced it (whose inputs are the three splits).
    version = tracking.register("lineage-test", run_id, tags={})
    # The OSS registry keeps the logged model in the version's source (models:/<model_id>),
    # what the version page's "Source model" link opens.
    model = client.get_logged_model(version.source.removeprefix("models:/"))
    assert model.source_run_id == run_id
    assert [o.model_id for o in mlrun.outputs.model_outputs] == [model.model_id]
    linked = {(m.key, m.dataset_name, m.dataset_digest) for m in model.metrics if m.dataset_name}
    assert linked == {
        ("loss/train", "python-stdlib-train", inputs["training"].digest),
        ("loss/val", "python-stdlib-val", inputs["validation"].digest),
    }
    # Linked, not logged again: the run's curve keeps one point at the exported step.
    assert [m.step for m in client.get_metric_history(run_id, "loss/train")].count(20) == 1


def test_dataset_sources_and_names():
    for source, source_type, name in (
        ("python-stdlib", "code", "python-stdlib"),
        ("data/own/*.jsonl", "local", "own"),
        ("/corpora/shakespeare.txt", "local", "shakespeare"),
        ("https://example.org/data/tiny.txt.gz", "http", "tiny"),
        ("s3://bucket/corpora/code/", "s3", "code"),
        ("az://container/corpus.parquet", "code", "corpus"),
    ):
        assert tracking.dataset_source(source)._get_source_type() == source_type, source
        assert tracking.corpus_name(source) == name, source
