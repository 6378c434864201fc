"""Model resolution: a local directory, or `models:/lmops@champion` through a real
(local, sqlite) MLflow registry holding the model directory as run artifacts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lmops.errors import LmopsError
from lmops.pipeline.scratch_registry import local_registry
from production_service.model_source import resolve_model


def test_local_directory_with_partial_metadata(model_dir, tmp_path):
    info = resolve_model(model_dir)
    assert (info.path, info.name, info.version, info.run_id) == (model_dir, "lmops-tiny", "7", "run-tiny")
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_text("{}")
    (bare / "lmops.json").write_text(json.dumps({"data_sha256": "abc"}))
    assert (resolve_model(bare).name, resolve_model(bare).version) == ("bare", None)
    with pytest.raises(LmopsError, match="missing config.json"):
        resolve_model(tmp_path / "nowhere")


@pytest.fixture
def registry(model_dir, tmp_path, monkeypatch) -> str:
    """A local sqlite MLflow registry whose lmops@champion holds `model_dir`; its run id."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    registry = local_registry(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry.uri)
    return registry.register(model_dir, "champion").run_id


def test_registry_alias_resolves_to_the_model_directory(registry, tmp_path):
    cache = tmp_path / "cache"
    info = resolve_model(tmp_path / "unused", "models:/lmops@champion", cache)
    assert (info.path / "config.json").is_file() and (info.path / "model.safetensors").is_file()
    assert (info.name, info.version, info.run_id) == ("lmops", "1", registry)
    assert info.source == "models:/lmops@champion"
    assert resolve_model(tmp_path, "models:/lmops/1", cache).version == "1"
    with pytest.raises(LmopsError, match="models:/lmops@nope"):
        resolve_model(tmp_path, "models:/lmops@nope", cache)


def test_downloads_are_cached_by_version_reused_pruned_and_atomic(registry, tmp_path, monkeypatch):
    """Every worker boot used to download a fresh copy into /tmp and never remove it (the
    fifth restart hit ENOSPC). Now: one directory per version, reused, the rest pruned."""
    import mlflow

    from production_service import model_source

    cache = tmp_path / "cache"
    (cache / "lmops-v0").mkdir(parents=True)  # an older version
    (cache / ".lmops-v1.x1y2.tmp").mkdir()  # a download killed midway
    info = resolve_model(tmp_path, "models:/lmops@champion", cache)
    assert info.path == cache / "lmops-v1"
    assert sorted(p.name for p in cache.iterdir()) == [".lock", "lmops-v1"]

    real_download = model_source.download

    def no_download(uri, dst):
        raise AssertionError("downloaded again")

    monkeypatch.setattr(model_source, "download", no_download)
    assert resolve_model(tmp_path, "models:/lmops@champion", cache).path == info.path  # a restart: reused

    client = mlflow.MlflowClient()
    source = client.get_model_version("lmops", "1").source
    client.create_model_version("lmops", source, run_id=registry)
    client.set_registered_model_alias("lmops", "champion", "2")

    def killed(uri, dst):  # a download that dies after writing part of the model
        (real_download(uri, dst) / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(model_source, "download", killed)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(tmp_path, "models:/lmops@champion", cache)
    assert sorted(p.name for p in cache.iterdir()) == [".lock", "lmops-v1"]  # nothing looks like v2

    monkeypatch.setattr(model_source, "download", real_download)
    v2 = resolve_model(tmp_path, "models:/lmops@champion", cache)
    assert (v2.path, v2.version) == (cache / "lmops-v2", "2")
    assert sorted(p.name for p in cache.iterdir()) == [".lock", "lmops-v2"]  # the current one stays

    (v2.path / "model.safetensors").write_bytes(b"\xff" * 64)  # damaged on disk: fetched again
    assert resolve_model(tmp_path, "models:/lmops@champion", cache).path == v2.path
    assert (v2.path / "model.safetensors").read_bytes() != b"\xff" * 64


@pytest.mark.parametrize(
    ("meta", "want"),
    [
        ({"metrics": {"test_bits_per_byte": 3.0}}, 3.0),  # what promotion exports
        ({"metrics": {"val_loss": 1.0}}, None),
        ({"metrics": {"test_bits_per_byte": "high"}}, None),
        (None, None),  # a plain HF Llama directory
    ],
)
def test_reference_bits_per_byte_from_lmops_json(tmp_path, meta, want):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_text("{}")
    if meta is not None:
        (tmp_path / "lmops.json").write_text(json.dumps(meta))
    assert resolve_model(tmp_path).reference_bits_per_byte == want


def test_a_corrupt_lmops_json_is_an_error_naming_it(model_dir, tmp_path):
    """Not a silent fallback to the directory's name (requests for the model's name would 404)."""
    import shutil

    broken = shutil.copytree(model_dir, tmp_path / "broken")
    (broken / "lmops.json").write_text("{not json")
    with pytest.raises(LmopsError, match=r"lmops\.json: unreadable lmops\.json"):
        resolve_model(broken)


@pytest.mark.slow
def test_a_registry_download_imports_no_pipeline_code(registry, tmp_path):
    """The serving image has the MLflow client, not lmops' pipeline (tests/unit/test_layers.py)."""
    probe = (
        "import json, sys; from pathlib import Path; import production_service.app; "
        "from production_service.model_source import resolve_model; "
        "info = resolve_model(Path('unused'), 'models:/lmops@champion', Path('cache')); "
        "print(json.dumps([info.version, sorted(sys.modules)]))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    version, loaded = json.loads(out.stdout.splitlines()[-1])
    assert version == "1"
    crossed = [
        m for m in loaded if m.startswith("lmops.pipeline") or m.split(".")[0] in ("dvc", "transformers")
    ]
    assert not crossed, f"a registry download loads pipeline modules: {crossed}"
