"""Model resolution: a local directory, or `models:/lmops@champion` through a real
(local, sqlite) MLflow registry holding the model directory as run artifacts."""

from __future__ import annotations

import json

import pytest

from lmops.errors import LmopsError
from production_service.model_source import resolve_model


def test_local_directory_with_partial_metadata(model_dir, tmp_path):
    info = resolve_model(model_dir)
    assert (info.path, info.name, info.version, info.run_id) == (model_dir, "lmops-tiny", "7", "run-tiny")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    (bare / "lmops.json").write_text(json.dumps({"data_sha256": "abc"}))
    assert (resolve_model(bare).name, resolve_model(bare).version) == ("bare", None)
    with pytest.raises(LmopsError, match="missing config.json"):
        resolve_model(tmp_path / "nowhere")


def test_registry_alias_resolves_to_the_model_directory(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow

    client = mlflow.MlflowClient()
    experiment = client.create_experiment("service", artifact_location=str(tmp_path / "artifacts"))
    run = client.create_run(experiment)
    # the layout the pipeline's pyfunc has: the model directory under artifacts/model_dir
    client.log_artifacts(run.info.run_id, str(model_dir), "model/artifacts/model_dir")
    client.set_terminated(run.info.run_id)
    client.create_registered_model("lmops")
    version = client.create_model_version("lmops", f"{run.info.artifact_uri}/model", run_id=run.info.run_id)
    client.set_registered_model_alias("lmops", "champion", version.version)

    info = resolve_model(tmp_path / "unused", "models:/lmops@champion")
    assert (info.path / "config.json").is_file() and (info.path / "model.safetensors").is_file()
    assert (info.name, info.version, info.run_id) == ("lmops", "1", run.info.run_id)
    assert info.source == "models:/lmops@champion"
    assert resolve_model(tmp_path, "models:/lmops/1").version == "1"
    with pytest.raises(LmopsError, match="models:/lmops@nope"):
        resolve_model(tmp_path, "models:/lmops@nope")


@pytest.mark.parametrize(
    ("meta", "want"),
    [
        ({"reference_bits_per_byte": 2.5, "metrics": {"test_bits_per_byte": 3.0}}, 2.5),
        ({"metrics": {"test_bits_per_byte": 3.0}}, 3.0),  # what promotion has always exported
        ({"metrics": {"val_loss": 1.0}}, None),
        ({"reference_bits_per_byte": "high"}, None),
    ],
)
def test_reference_bits_per_byte_from_lmops_json(tmp_path, meta, want):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "lmops.json").write_text(json.dumps(meta))
    assert resolve_model(tmp_path).reference_bits_per_byte == want
