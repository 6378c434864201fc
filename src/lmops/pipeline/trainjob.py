"""`lmops trainjob`: the train stage as a Kubeflow Trainer v2 TrainJob, launched from the
KFP pipeline's train step and waited for.

The step has staged the stage's inputs in the working directory. They go to a directory of
their own on the shared ReadWriteMany volume (WORKSPACE/runs/<name>), so two runs never
share files; the TrainJob is kubeflow/trainjob.yaml's own (its nodes, resources and
runtime), with a fresh name, the step's image and MLflow server, and torchrun started in
that directory. When it is Complete the model and the training logs come back here and
the TrainJob and its directory go. When it fails or does not finish in time the step
fails with one line naming it and its pods' logs; a failed TrainJob stays for inspection,
and so does the directory of one that may still be running.
"""

from __future__ import annotations

import copy
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from lmops import atomic
from lmops.errors import LmopsError
from lmops.pipeline.paths import MODEL_DIR, TRAIN_LOG_FILE, VAL_LOG_FILE

GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
# JobSet, which runs a TrainJob's pods, labels them with its name (the TrainJob's).
POD_LABEL = "jobset.sigs.k8s.io/jobset-name"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# What the train stage writes that the next steps and users need (dvc.yaml's outs).
OUTPUTS = (TRAIN_LOG_FILE, VAL_LOG_FILE, MODEL_DIR)  # the model last: it marks success


def new_name(base: str) -> str:
    """A fresh DNS label from the manifest's name: its time, then random hex for two at once."""
    return f"{base}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"


def manifest_trainjob(manifest: Path) -> dict[str, Any]:
    """The one TrainJob of `manifest` (kubeflow/trainjob.yaml)."""
    try:
        docs = list(yaml.safe_load_all(manifest.read_text()))
    except (OSError, yaml.YAMLError) as exc:
        raise LmopsError(f"cannot read the TrainJob manifest {manifest}: {exc}") from None
    found = [d for d in docs if isinstance(d, dict) and d.get("kind") == "TrainJob"]
    if len(found) != 1:
        raise LmopsError(f"{manifest}: expected one TrainJob, found {len(found)}")
    return found[0]


def for_run(job: dict[str, Any], image: str, run_dir: Path, timeout: int | None) -> dict[str, Any]:
    """`job` patched for one run: named after `run_dir`, the step's image and MLflow server,
    torchrun in `run_dir`, and a deadline (`timeout`, else the job's activeDeadlineSeconds)."""
    job = copy.deepcopy(job)
    spec, trainer = job["spec"], job["spec"]["trainer"]
    job["metadata"]["name"] = run_dir.name
    trainer["image"] = image
    # The runtime's pods start in the volume's root: the command runs in the run's directory.
    trainer["command"] = ["sh", "-c", 'cd "$0" && exec "$@"', str(run_dir), *trainer["command"]]
    if os.environ.get("MLFLOW_TRACKING_URI"):
        env = [e for e in trainer.get("env", []) if e["name"] != "MLFLOW_TRACKING_URI"]
        trainer["env"] = [*env, {"name": "MLFLOW_TRACKING_URI", "value": os.environ["MLFLOW_TRACKING_URI"]}]
    if timeout is not None and timeout < 1:
        raise LmopsError(f"--timeout {timeout}: expected a positive number of seconds")
    spec["activeDeadlineSeconds"] = timeout or spec.get("activeDeadlineSeconds")
    if not spec["activeDeadlineSeconds"]:
        raise LmopsError("the TrainJob has no activeDeadlineSeconds: give --timeout")
    return job


def connect(namespace: str | None):
    """The custom-objects API and the namespace: the pod's own in a pod, else the kubeconfig's."""
    try:
        config.load_incluster_config()
        namespace = namespace or SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    except config.ConfigException:
        kubeconfig = os.environ.get("KUBECONFIG")  # now: the client reads it once, at import
        try:
            config.load_kube_config(kubeconfig)
        except config.ConfigException as exc:
            raise LmopsError(f"no Kubernetes API: not in a pod, and no kubeconfig ({exc})") from None
        _, context = config.list_kube_config_contexts(kubeconfig)
        namespace = namespace or context["context"].get("namespace", "default")
    return client.CustomObjectsApi(), namespace


def api_error(exc: ApiException | HTTPError, doing: str) -> LmopsError:
    """One line for a failed API call: what it was doing and what the server said."""
    if not isinstance(exc, ApiException):
        return LmopsError(f"{doing}: cannot reach the Kubernetes API: {exc}")
    try:
        said = yaml.safe_load(exc.body or "")["message"]
    except (TypeError, KeyError, yaml.YAMLError):
        said = exc.reason
    hint = {
        403: " (the step's service account needs the RBAC of kubeflow/trainjob.yaml)",
        404: " (is Kubeflow Trainer v2 installed, and the TrainJob still there?)",
    }.get(exc.status, "")
    return LmopsError(f"{doing}: HTTP {exc.status}: {said}{hint}")


def state(job: dict[str, Any]) -> tuple[str, str]:
    """(Failed | Complete | Suspended | Running | Pending, details) from the TrainJob's status."""
    status = job.get("status") or {}
    true = {c["type"]: c for c in status.get("conditions") or [] if c.get("status") == "True"}
    for kind in ("Failed", "Complete", "Suspended"):
        if kind in true:
            return kind, f"{true[kind].get('reason', '')}: {true[kind].get('message', '')}"
    jobs = status.get("jobsStatus") or []
    counts = "; ".join(
        f"{j['name']}: " + ", ".join(f"{j.get(k, 0)} {k}" for k in ("active", "ready", "succeeded", "failed"))
        for j in jobs
    )
    return ("Running" if any(j.get("active") for j in jobs) else "Pending"), counts


def wait(api, namespace: str, name: str, timeout: float, poll: float) -> tuple[str, str] | None:
    """Poll until the TrainJob is Complete or Failed (its state), printing each change; None
    at the timeout. The server's own errors (5xx, no answer) are retried; a refusal is not."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            now = state(api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))
        except (ApiException, HTTPError) as exc:
            if isinstance(exc, ApiException) and exc.status < 500:
                raise api_error(exc, f"reading TrainJob {name}") from None
            now = ("Unknown", str(api_error(exc, "reading it")))
        if now != last:
            print(f"trainjob {name}: {now[0]}" + (f" ({now[1]})" if now[1] else ""), flush=True)
            last = now
        if now[0] in ("Complete", "Failed"):
            return now
        time.sleep(poll)
    return None


def collect(run_dir: Path, name: str) -> None:
    """The run's outputs into the working directory, each whole or not at all."""
    for path in OUTPUTS:
        source = run_dir / path
        if not source.exists():
            raise LmopsError(f"TrainJob {name} completed without writing {path} in {run_dir}")
        if source.is_dir():
            with atomic.directory(path) as tmp:
                shutil.copytree(source, tmp, dirs_exist_ok=True)
        else:
            atomic.write_bytes(path, source.read_bytes())


def launch(
    manifest: Path,
    image: str,
    workspace: Path,
    namespace: str | None = None,
    timeout: int | None = None,
    poll: float = 10.0,
    dry_run: bool = False,
) -> None:
    """Stage, create, wait, collect (module docstring); `dry_run`: print the TrainJob only."""
    template = manifest_trainjob(manifest)
    run_dir = workspace / "runs" / new_name(template["metadata"]["name"])
    job, name = for_run(template, image, run_dir, timeout), run_dir.name
    if dry_run:
        print(yaml.safe_dump(job, sort_keys=False), end="")
        return
    api, namespace = connect(namespace)
    logs = f"kubectl -n {namespace} logs -l {POD_LABEL}={name}"
    try:
        shutil.copytree(Path.cwd(), run_dir)
    except OSError as exc:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise LmopsError(f"cannot stage the workspace in {run_dir}: {exc}") from None
    print(f"trainjob {name}: staged the workspace in {run_dir}", flush=True)
    created, final = False, None
    try:
        try:
            api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job)
        except (ApiException, HTTPError) as exc:
            raise api_error(exc, f"creating TrainJob {name} in namespace {namespace}") from None
        created = True
        final = wait(api, namespace, name, job["spec"]["activeDeadlineSeconds"], poll)
        if final and final[0] == "Complete":
            collect(run_dir, name)
    finally:
        if final or not created:  # no pod uses the run's files any more
            shutil.rmtree(run_dir, ignore_errors=True)
    if final is None:
        raise LmopsError(
            f"TrainJob {name} did not finish within {job['spec']['activeDeadlineSeconds']} s (Trainer "
            f"stops it at its activeDeadlineSeconds); logs: {logs}; its files: {run_dir}"
        )
    if final[0] == "Failed":
        raise LmopsError(
            f"TrainJob {name} failed ({final[1]}); logs: {logs}; kept for inspection "
            f"(kubectl -n {namespace} delete trainjob {name})"
        )
    try:
        api.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        gone = "deleted"
    except (ApiException, HTTPError) as exc:  # the model is here: a leftover TrainJob does not fail the step
        gone = f"not deleted: {api_error(exc, 'deleting it')}"
    print(f"trainjob {name}: Complete, {MODEL_DIR} copied back; the TrainJob {gone}", flush=True)
