"""A throwaway MLflow registry: SQLite under a directory, model directories registered as
versions of `lmops` in the layout the pipeline's pyfunc logs (the directory under
model/artifacts/model_dir), aliases moved as `lmops promote` moves them. What the service
tests and benchmarks/swap.py promote into; a real registry, no server."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

NAME = "lmops"


@dataclass
class Registry:
    uri: str  # the tracking and registry URI (sqlite:///...)
    client: object  # mlflow.MlflowClient
    experiment: str

    def register(self, model_dir: Path, alias: str | None = None):
        """`model_dir` as the next version (a run's artifacts); `alias` moved to it."""
        run = self.client.create_run(self.experiment)
        self.client.log_artifacts(run.info.run_id, str(model_dir), "model/artifacts/model_dir")
        self.client.set_terminated(run.info.run_id)
        version = self.client.create_model_version(
            NAME, f"{run.info.artifact_uri}/model", run_id=run.info.run_id
        )
        if alias is not None:
            self.move(alias, version.version)
        return version

    def move(self, alias: str, version) -> None:
        self.client.set_registered_model_alias(NAME, alias, str(version))


def local_registry(root: Path) -> Registry:
    """A new registry under `root` holding the registered model `lmops`, no versions yet."""
    import mlflow

    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    experiment = client.create_experiment("service", artifact_location=str(root / "artifacts"))
    client.create_registered_model(NAME)
    return Registry(uri, client, experiment)
