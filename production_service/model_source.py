"""Where the served model comes from: a local model directory, or the MLflow
registry (`models:/lmops@champion`), downloaded once to a local directory."""

from __future__ import annotations

import logging
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lmops.errors import LmopsError
from lmops.runtime.model_dir import CONFIG_FILE, ModelMeta, download, read_meta

log = logging.getLogger(__name__)

_REGISTRY_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))$")


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    name: str
    version: str | None = None
    run_id: str | None = None
    source: str = ""
    meta: ModelMeta | None = None  # lmops.json; None for a plain HF Llama directory

    @property
    def reference_bits_per_byte(self) -> float | None:
        """Test bits/byte at promotion: the drift signal's baseline."""
        return None if self.meta is None else self.meta.reference_bits_per_byte


def resolve_model(model_dir: Path, model_uri: str | None = None) -> ModelInfo:
    """The local directory to load and what is known about it (registry facts win
    over lmops.json, which a plain HF Llama directory does not have)."""
    if model_uri:
        path, registry = _download(model_uri)
    else:
        path, registry = Path(model_dir), {}
        if not (path / CONFIG_FILE).is_file():
            raise LmopsError(
                f"{path}: not a model directory (missing {CONFIG_FILE}); "
                "run `make run` to promote one, or set LMOPS_MODEL_DIR / LMOPS_MODEL_URI"
            )
    meta = read_meta(path)  # the weights are verified when the engine loads them
    facts = (
        {}
        if meta is None
        else {"model_name": meta.model_name, "model_version": meta.model_version, "run_id": meta.run_id}
    )
    facts.update(registry)
    version = facts.get("model_version")
    return ModelInfo(
        path=path,
        name=str(facts.get("model_name") or path.name),
        version=None if version is None else str(version),
        run_id=facts.get("run_id"),
        source=model_uri or str(path),
        meta=meta,
    )


def _download(uri: str) -> tuple[Path, dict]:
    from mlflow.exceptions import MlflowException

    path = download(uri, Path(tempfile.mkdtemp(prefix="lmops-model-")))
    try:
        registry = _registry_facts(uri)
    except MlflowException as exc:
        raise LmopsError(f"cannot resolve {uri}: {exc.message}") from None
    log.info("resolved %s to %s", uri, path)
    return path, registry


def _registry_facts(uri: str) -> dict:
    """Name, version and run id of a `models:/name@alias` or `models:/name/N` URI."""
    match = _REGISTRY_URI.match(uri)
    if not match:
        return {}
    from mlflow import MlflowClient

    client = MlflowClient()
    if match["alias"]:
        mv = client.get_model_version_by_alias(match["name"], match["alias"])
    else:
        mv = client.get_model_version(match["name"], match["version"])
    return {"model_name": mv.name, "model_version": str(mv.version), "run_id": mv.run_id}
