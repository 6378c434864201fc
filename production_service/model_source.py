"""Where the served model comes from: a local model directory, or the MLflow
registry (`models:/lmops@champion`), downloaded once to a local directory."""

from __future__ import annotations

import json
import logging
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lmops.errors import LmopsError

log = logging.getLogger(__name__)

_REGISTRY_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))$")


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    name: str
    version: str | None = None
    run_id: str | None = None
    source: str = ""
    reference_bits_per_byte: float | None = None  # test bits/byte at promotion (the drift baseline)


def resolve_model(model_dir: Path, model_uri: str | None = None) -> ModelInfo:
    """The local directory to load and what is known about it (registry facts win
    over lmops.json, whose keys may be missing)."""
    if model_uri:
        path, registry = _download(model_uri)
    else:
        path, registry = Path(model_dir), {}
        if not (path / "config.json").is_file():
            raise LmopsError(
                f"{path}: not a model directory (missing config.json); "
                "run `make run` to promote one, or set LMOPS_MODEL_DIR / LMOPS_MODEL_URI"
            )
    meta = _read_meta(path)
    facts = {**{k: meta.get(k) for k in ("model_name", "model_version", "run_id")}, **registry}
    version = facts.get("model_version")
    return ModelInfo(
        path=path,
        name=str(facts.get("model_name") or path.name),
        version=None if version is None else str(version),
        run_id=facts.get("run_id"),
        source=model_uri or str(path),
        reference_bits_per_byte=reference_bits_per_byte(meta),
    )


def reference_bits_per_byte(meta: dict) -> float | None:
    """The model's test bits/byte from lmops.json: `reference_bits_per_byte`, else the
    `metrics.test_bits_per_byte` that promotion has always exported."""
    value = meta.get("reference_bits_per_byte")
    if value is None:
        metrics = meta.get("metrics")
        value = metrics.get("test_bits_per_byte") if isinstance(metrics, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        return None
    return float(value)


def _read_meta(path: Path) -> dict:
    try:
        meta = json.loads((path / "lmops.json").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _download(uri: str) -> tuple[Path, dict]:
    from mlflow.exceptions import MlflowException

    from lmops.registry import download_model_dir

    path = download_model_dir(uri, Path(tempfile.mkdtemp(prefix="lmops-model-")))
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
