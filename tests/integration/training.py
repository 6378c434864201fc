"""Helpers of the training tests (test_train_resume.py, test_train_runs.py): projects
copied from the session's tokenized one, and what a run left behind."""

from __future__ import annotations

import shutil

import yaml
from safetensors.torch import load_file


def copy_project(src, dst):
    shutil.copytree(src, dst)
    return dst


def with_dropout(project, compile: bool):
    """With dropout, so that the masks (drawn from the RNG a checkpoint saves) are part of what resumes."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["model"]["dropout"] = 0.1
    params["train"]["compile"] = compile
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return project


def weights(project):
    return load_file(str(project / "artifacts/model/model.safetensors"))


def val_losses(project):
    rows = [r.split(",") for r in (project / "artifacts/plots/val_log.csv").read_text().splitlines()[1:]]
    return {int(r[0]): float(r[2]) for r in rows}


def mlflow_run(project, run_id):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{project}/mlflow.db").get_run(run_id)
