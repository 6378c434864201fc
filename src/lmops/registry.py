"""Fetching a logged model with the MLflow client alone: the runtime side of the
registry, shared by the service (LMOPS_MODEL_URI) and promotion, and free of
pipeline imports so the serving image can use it."""

from __future__ import annotations

from pathlib import Path

from lmops.errors import LmopsError


def download_model_dir(model_uri: str, dst: Path) -> Path:
    """Download a logged model (`models:/name@alias`, `runs:/...`) into `dst`; return its model directory."""
    import mlflow.artifacts  # lazily: ~2 s, and only a registry download needs it
    from mlflow.exceptions import MlflowException

    try:
        root = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(dst)))
    except MlflowException as exc:
        raise LmopsError(f"could not download {model_uri}: {exc.message}") from None
    for config in sorted(root.rglob("config.json")):
        if (config.parent / "model.safetensors").is_file():
            return config.parent
    raise LmopsError(f"{model_uri} holds no model directory (no config.json + model.safetensors)")
