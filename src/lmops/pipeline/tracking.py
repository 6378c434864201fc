"""MLflow: where runs go, what each stage logs, the registry and promotion.

Tracking defaults to `sqlite:///mlflow.db` with artifacts under artifacts/mlruns;
`MLFLOW_TRACKING_URI` switches to a server. The model is logged without pickle:
a models-from-code pyfunc (`lmops/mlflow_pyfunc.py`) around the safetensors
model directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import subprocess
import time
import warnings
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

from lmops.errors import LmopsError
from lmops.pipeline.params import MlflowConfig, Params
from lmops.pipeline.paths import DATA_REPORT_FILE, PROCESSED_DIR, THROUGHPUT_FILE, TOKENIZER_DIR, TOKENS_DIR
from lmops.pipeline.sources import STDLIB, stdlib_origin

log = logging.getLogger(__name__)

LMOPS_PACKAGE = Path(__file__).resolve().parents[1]  # src/lmops, shipped with the pyfunc
PYFUNC_FILE = LMOPS_PACKAGE / "runtime" / "mlflow_pyfunc.py"
MODEL_ARTIFACT = "model"
# What the pyfunc's runtime imports (lmops.runtime: never the pipeline's dependencies).
PYFUNC_DEPENDENCIES = ("torch", "numpy", "tokenizers", "safetensors", "pydantic", "prometheus-client")


def _mlflow():
    # Imported lazily: mlflow takes ~2 s to import and most commands never need it.
    import mlflow

    return mlflow


def tracking_uri(cfg: MlflowConfig) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or cfg.tracking_uri


@contextlib.contextmanager
def store_errors(uri: str) -> Iterator[None]:
    """Turn MLflow store failures into one-line `LmopsError`s.

    A store locked by another process (sqlite) is already waited on: MLflow sets
    SQLite's busy timeout to 20 s, which retries until the lock is released. Past
    that, MLflow logs the SQLAlchemy traceback and raises; the user gets one line. A
    tracking server that does not answer is retried by MLflow's REST client
    (MLFLOW_HTTP_REQUEST_MAX_RETRIES, 7 by default with exponential backoff: about 4 minutes)
    before the line names it.
    """
    mlflow = _mlflow()
    if not log.isEnabledFor(logging.DEBUG):  # `lmops -v` still shows MLflow's traceback
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    try:
        yield
    except mlflow.exceptions.MlflowException as exc:
        first = str(exc.message).strip().splitlines()[0] if str(exc.message).strip() else exc.error_code
        if "database is locked" in first:
            raise LmopsError(
                f"MLflow tracking store {uri} is locked by another process (still locked after "
                "20 s): run the command again when it is free"
            ) from None
        if "Max retries exceeded" in first:  # the REST client's retries are spent
            cause = re.search(
                r"\[Errno -?\d+\] [^\"')]+|Read timed out|Remote end closed connection[^\"')]*", first
            )
            raise LmopsError(
                f"MLflow tracking server {uri} is unreachable ({cause[0] if cause else 'no answer'}, "
                f"after {mlflow.environment_variables.MLFLOW_HTTP_REQUEST_MAX_RETRIES.get()} retries): "
                "start it, or point MLFLOW_TRACKING_URI at one"
            ) from None
        raise LmopsError(f"MLflow tracking at {uri}: {first}") from None


# The MLflow UI opens an experiment of this kind on its runs and models, not its GenAI
# (traces) view.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


def configure(cfg: MlflowConfig) -> str:
    """Point MLflow at the tracking store; return the experiment id (created if needed, as a
    model-training experiment)."""
    mlflow = _mlflow()
    uri = tracking_uri(cfg)
    mlflow.set_tracking_uri(uri)
    with store_errors(uri):
        exp = mlflow.get_experiment_by_name(cfg.experiment)
        if exp is not None:
            for key, value in EXPERIMENT_KIND.items():
                if exp.tags.get(key) != value:
                    client().set_experiment_tag(exp.experiment_id, key, value)
            return exp.experiment_id
        local = uri.startswith(("sqlite:", "file:")) or "://" not in uri
        location = Path(cfg.artifact_location).resolve().as_uri() if local else None
        return mlflow.create_experiment(cfg.experiment, artifact_location=location, tags=EXPERIMENT_KIND)


def client():
    return _mlflow().MlflowClient()


def git_commit() -> str:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _flatten(params: Params) -> dict[str, str]:
    flat = {}
    for section, values in params.model_dump().items():
        for key, value in values.items():
            flat[f"{section}.{key}"] = json.dumps(value) if isinstance(value, list) else str(value)
    return flat


def start_training_run(params: Params, run_id: str | None, data_sha256: str | None):
    """A new run, or the interrupted one a resumed training continues."""
    experiment_id = configure(params.mlflow)
    c = client()
    if run_id:
        try:
            c.update_run(run_id, status="RUNNING")
            return c.get_run(run_id)
        except _mlflow().exceptions.MlflowException:
            log.warning(
                "run %s of the checkpoint is gone from the tracking store; starting a new run", run_id
            )
    tags = {
        "git_commit": git_commit(),
        "data_sha256": data_sha256 or "unknown",
        "stage": "train",
        "mlflow.runName": f"train-{time.strftime('%Y%m%d-%H%M%S')}",
    }
    return c.create_run(experiment_id, tags=tags)


def log_params_once(params: Params, run_id: str, extra: dict) -> None:
    c = client()
    logged = c.get_run(run_id).data.params
    Param = _mlflow().entities.Param
    todo = {**_flatten(params), **{k: str(v) for k, v in extra.items()}}
    batch = [Param(k, v) for k, v in todo.items() if k not in logged]
    for i in range(0, len(batch), 100):
        c.log_batch(run_id, params=batch[i : i + 100])


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def log_data_report(run_id: str, path: Path = DATA_REPORT_FILE) -> None:
    """The data checks of the corpus this run trains on (written by `lmops split`), beside its
    numbers, and what the data stages did: bytes, documents, tokens, shards, throughput."""
    if not path.is_file():
        return
    report = json.loads(path.read_text())
    client().log_dict(run_id, report, "data_report.json")
    counts = ("documents", "bytes", "empty_documents_dropped", "duplicates_merged")
    metrics = {f"data_{k}": report.get(k) for k in counts}
    index, stats = _json(TOKENS_DIR / "index.json"), _json(TOKENIZER_DIR / "stats.json")
    splits = index.get("splits", {}).values()
    metrics |= {
        "data_tokens": sum(s["tokens"] for s in splits) if splits else None,
        "data_shards": sum(len(s["shards"]) for s in splits) if splits else None,
        "data_tokenizer_trained_on_bytes": stats.get("trained_on_bytes"),
    }
    throughput = _json(THROUGHPUT_FILE)
    for stage in ("get_data", "split", "tokenize"):
        metrics[f"data_{stage}_mb_per_s"] = throughput.get(stage, {}).get("mb_per_s")
    log_metrics(run_id, metrics)


def log_metrics(run_id: str, metrics: dict[str, float | None], step: int = 0) -> None:
    Metric = _mlflow().entities.Metric
    now = int(time.time() * 1000)
    batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None]
    client().log_batch(run_id, metrics=batch)


# The loss curves' names in MLflow. The UI groups metrics named `prefix/...` into a section
# of that name and lists such sections before its alphabetical "Model metrics" one, so the
# two curves people look at first open the run's charts, side by side (the CSV logs keep
# the column names train_loss and val_loss).
CURVE_NAMES = {"train_loss": "loss/train", "val_loss": "loss/val"}
SPLIT_CURVES = {"train": "loss/train", "val": "loss/val"}  # the split each curve is measured on


def log_step(run_id: str, row: dict) -> None:
    metrics = {CURVE_NAMES.get(k, k): v for k, v in row.items() if k != "step"}
    log_metrics(run_id, metrics, step=int(row["step"]))


# -- lineage: the splits as the run's dataset inputs, and the model's metrics on them ----

# MLflow's context names (the `mlflow.data.context` input tag the UI shows beside a dataset).
SPLIT_CONTEXTS = {"train": "training", "val": "validation", "test": "testing"}
# MLflow stores at most 36 characters of a dataset digest (MAX_DATASET_DIGEST_SIZE); the
# profile keeps the whole sha256.
DIGEST_CHARS = 36


def corpus_name(source: str) -> str:
    """The datasets' name stem: the same for every version of a corpus, so the UI lists the
    versions of `<corpus>-train` by digest (e.g. data/own/*.jsonl -> own)."""
    if source == STDLIB:
        return STDLIB
    parts = [p for p in PurePosixPath(urlparse(source).path).parts if p != "/" and not set(p) & set("*?[")]
    return (parts[-1].split(".")[0] if parts else "") or "corpus"


def dataset_source(source: str):
    """`data.source` as the MLflow source type that fits it (local, http, s3, gs); "code" where
    no file names the data: the standard library lmops reads from the interpreter, and
    schemes MLflow has no type for (az://)."""
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.dataset_source_registry import resolve_dataset_source

    if source != STDLIB:
        try:
            with warnings.catch_warnings():
                # "can be interpreted in multiple ways": two local-artifact resolvers, same answer
                warnings.simplefilter("ignore", UserWarning)
                return resolve_dataset_source(source)
        except _mlflow().exceptions.MlflowException:
            pass
    return CodeDatasetSource({"data.source": stdlib_origin() if source == STDLIB else source})


def log_splits(
    run_id: str, source: str, splits_dir: Path = PROCESSED_DIR, report_path: Path = DATA_REPORT_FILE
) -> None:
    """Log the train/val/test files as the run's dataset inputs (digest: their sha256, hashed
    streaming), so the run, and the model it logs, name the exact data. A resumed run logs
    them again at no cost: MLflow keeps one input per run, dataset name and digest."""
    mlflow = _mlflow()
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    stats = _json(report_path).get("split", {})
    origin, name = dataset_source(source), corpus_name(source)
    inputs = []
    for split, context in SPLIT_CONTEXTS.items():
        path = splits_dir / f"{split}.txt"
        if not path.is_file():  # lineage is no reason to stop a training
            log.warning("%s not found: the MLflow run names no %s dataset", path, context)
            continue
        with open(path, "rb") as f:
            sha256 = hashlib.file_digest(f, "sha256").hexdigest()
        meta = MetaDataset(origin, name=f"{name}-{split}", digest=sha256[:DIGEST_CHARS]).to_dict()
        profile = {
            "sha256": sha256,
            "bytes": path.stat().st_size,
            "documents": stats.get(split, {}).get("documents"),
        }
        dataset = mlflow.entities.Dataset(**meta, profile=json.dumps(profile))
        tags = [mlflow.entities.InputTag(MLFLOW_DATASET_CONTEXT, context)]
        inputs.append(mlflow.entities.DatasetInput(dataset, tags=tags))
    client().log_inputs(run_id, datasets=inputs)


def link_model_to_splits(run_id: str, step: int) -> None:
    """Tie the run's logged model to the splits its losses were measured on: the run's loss
    points at `step` (the exported weights') logged again with the model and the split's dataset.
    Same key, step, value and timestamp, so the run's curves gain no point; the logged model's
    page lists its "Datasets used" from these links (MLflow 3 keeps no other dataset-to-model
    edge)."""
    c = client()
    Metric = _mlflow().entities.Metric
    batch = []
    for split, key in SPLIT_CURVES.items():
        link = model_link(run_id, split)
        if "dataset_name" not in link:
            continue
        points = [m for m in c.get_metric_history(run_id, key) if m.step == step]
        batch += [Metric(m.key, m.value, m.timestamp, m.step, **link) for m in points]
    c.log_batch(run_id, metrics=batch)


def model_link(run_id: str, split: str) -> dict:
    """What ties a metric to the run's logged model and to the `split` dataset the run logged
    (when it did): the logged model's page then lists the metric with its data."""
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    link = {"model_id": logged_model_uri(run_id).removeprefix("models:/")}
    for i in client().get_run(run_id).inputs.dataset_inputs:
        context = {t.key: t.value for t in i.tags}.get(MLFLOW_DATASET_CONTEXT)
        if context == SPLIT_CONTEXTS[split]:
            link.update(dataset_name=i.dataset.name, dataset_digest=i.dataset.digest)
    return link


def predict_signature(model_dir: Path):
    """The pyfunc's signature: a column of prompts in, a column of completions out, and the
    sampling params predict() takes, whose defaults are the model's own (generation_config.json;
    no seed: a fresh draw unless the caller gives one)."""
    from mlflow.models import ModelSignature, infer_signature
    from mlflow.types import ParamSchema, ParamSpec

    from lmops.runtime.engine import SamplingParams

    s = SamplingParams.from_model_dir(model_dir)
    io = infer_signature(["def "], ["completion"])
    params = [
        ParamSpec("max_tokens", "long", s.max_tokens),
        ParamSpec("temperature", "double", float(s.temperature)),
        ParamSpec("top_k", "long", s.top_k),
        ParamSpec("top_p", "double", float(s.top_p)),
        ParamSpec("seed", "long", None),
    ]
    return ModelSignature(inputs=io.inputs, outputs=io.outputs, params=ParamSchema(params))


def log_model(run_id: str, model_dir: Path) -> None:
    """Log the model directory as a pickle-free pyfunc (models from code) with the lmops package."""
    from importlib.metadata import version

    mlflow = _mlflow()
    with mlflow.start_run(run_id=run_id), warnings.catch_warnings():
        # Advice we decline on purpose: an input example would make MLflow load and run the
        # model while logging it (the signature is explicit).
        warnings.filterwarnings("ignore", message=".*An input example was not provided", category=UserWarning)
        mlflow.pyfunc.log_model(
            signature=predict_signature(model_dir),
            name=MODEL_ARTIFACT,
            python_model=str(PYFUNC_FILE),
            artifacts={"model_dir": str(model_dir)},
            code_paths=[str(LMOPS_PACKAGE)],
            pip_requirements=[f"{dist}=={version(dist).split('+')[0]}" for dist in PYFUNC_DEPENDENCIES],
        )


def set_tags(run_id: str, tags: dict[str, str]) -> None:
    RunTag = _mlflow().entities.RunTag
    client().log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])


def end_run(run_id: str, status: str = "FINISHED") -> None:
    client().set_terminated(run_id, status=status)


# -- registry and promotion ---------------------------------------------------------


def champion_version(name: str, alias: str):
    """The version `alias` points at; None only when the model or the alias does not
    exist (any other failure, e.g. a locked store, is raised, never read as "no champion")."""
    mlflow = _mlflow()
    try:
        return client().get_model_version_by_alias(name, alias)
    except mlflow.exceptions.MlflowException as exc:
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def logged_model_uri(run_id: str) -> str:
    """`models:/<model_id>` of the pyfunc the training run logged."""
    c = client()
    run = c.get_run(run_id)
    found = c.search_logged_models(
        [run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'", max_results=1
    )
    if not found:
        raise LmopsError(f"run {run_id} logged no model: run `lmops train` again")
    return found[0].model_uri


def register(name: str, run_id: str, tags: dict[str, str]):
    """The registry version of this run's model, created on first promotion attempt."""
    mlflow = _mlflow()
    c = client()
    try:
        c.get_registered_model(name)
    except mlflow.exceptions.MlflowException:
        c.create_registered_model(name, description="lmops Llama-style LM; @champion is what serves")
    existing = c.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    if existing:
        version = existing[0]
        for key, value in tags.items():
            c.set_model_version_tag(name, version.version, key, value)
        return version
    model_uri = logged_model_uri(run_id)  # models:/<model_id>
    model_id = model_uri.removeprefix("models:/")
    return c.create_model_version(name, source=model_uri, run_id=run_id, tags=tags, model_id=model_id)
