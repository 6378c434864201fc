"""The MLflow UI links `make mlflow-ui` prints before it starts the UI: the experiment's
runs, its newest run and the registered model.

Each carries `?workflowType=machine_learning`: MLflow 3 opens a browser it has not seen
before on its GenAI view (a traces overview, no Models link), whatever the experiment's
`mlflow.experimentKind`; the parameter opens the model-training view.
"""

from __future__ import annotations

from pathlib import Path

from lmops.errors import LmopsError
from lmops.pipeline import tracking
from lmops.pipeline.params import Params

VIEW = "workflowType=machine_learning"


def ui_links(params: Params, base_url: str) -> list[tuple[str, str]]:
    """(what, url) pairs, the newest run's included when the experiment has one."""
    uri = tracking.tracking_uri(params.mlflow)
    local = Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
    if local is not None and not local.is_file():  # opening it would create an empty store
        raise LmopsError(f"no tracking store at {local}: run `make run` first")
    mlflow = tracking._mlflow()
    mlflow.set_tracking_uri(uri)
    name = params.mlflow.experiment
    with tracking.store_errors(uri):
        experiment = mlflow.get_experiment_by_name(name)
        if experiment is None:
            raise LmopsError(f"no experiment {name!r} in {uri}: run `make run` first")
        newest = tracking.client().search_runs(
            [experiment.experiment_id], order_by=["attributes.start_time DESC"], max_results=1
        )
    base, exp_id = base_url.rstrip("/"), experiment.experiment_id
    links = [(f"experiment {name}", f"{base}/#/experiments/{exp_id}/runs?{VIEW}")]
    if newest:
        run = newest[0].info
        links.append(
            (f"newest run {run.run_name}", f"{base}/#/experiments/{exp_id}/runs/{run.run_id}?{VIEW}")
        )
    model = params.promote.model_name
    links.append((f"registered model {model}", f"{base}/#/models/{model}?{VIEW}"))
    return links
