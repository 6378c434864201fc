"""Shared by the deploy tests: where things are, the offline tools, and a runner for
the deploy/ scripts with made-up cloud settings (nothing here reaches a cloud)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from tests.conftest import make_tiny_model_dir

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# What Jenkins would provide; none of it is real. The secret values must never
# appear in a script's output.
CLOUD_ENV = {
    "ACR_NAME": "testacr",
    "AKS_RESOURCE_GROUP": "test-rg",
    "AKS_CLUSTER": "test-aks",
    "AWS_ACCOUNT_ID": "111122223333",
    "AWS_REGION": "eu-west-1",
    "EKS_CLUSTER": "test-eks",
    "EFS_FILE_SYSTEM_ID": "fs-0123456789abcdef0",
    "AZURE_CLIENT_ID": "test-client",
    "AZURE_TENANT_ID": "test-tenant",
    "KUBECONFIG": "/nonexistent/kubeconfig",
    "KFP_HOST": "https://kfp.invalid",
    "MLFLOW_TRACKING_URI": "http://mlflow.invalid:5000",
    "IMAGE_TAG": "0123abcd",
}
SECRETS = {
    "AZURE_CLIENT_SECRET": "az-secret-value",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-value",
    "LMOPS_API_KEY": "api-key-value",
    "KFP_TOKEN": "kfp-token-value",
}
# The kinds the overlays render that live in no namespace (the compile cache's StorageClass).
CLUSTER_SCOPED = ("Namespace", "StorageClass")
# Settings a developer's shell may hold that would change what the scripts do.
UNSET = (
    "CLOUD",
    "GPU",
    "CANARY",
    "CANARY_PERCENT",
    "COMPILE_CACHE_CLAIM",
    "ROLLOUT_TIMEOUT",
    "ROLLOUT_POLL",
    "PROMETHEUS_URL",
    "ANALYSIS_INTERVAL",
    "KFP_CRON",
    "DRY_RUN",
    "IMAGE",
    "KUBEFLOW_REGISTRY",
    "KUBEFLOW_NAMESPACE",
    "VENV",
    "DVC_REMOTE_CONFIG",
    "MODEL_URI",
    "EXPORT_DIR",
)


def tool(name: str) -> str:
    """A tool from requirements-dev.lock (.venv/bin first); skip the test when missing."""
    path = shutil.which(name, path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if path is None:
        pytest.skip(f"{name} is not installed: run `make install` (requirements-dev.lock)")
    return path


def script_env(path_prefix: str = "", **overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env.update(CLOUD_ENV, **SECRETS)
    env["PATH"] = os.pathsep.join(p for p in (path_prefix, str(BIN), env.get("PATH", "")) if p)
    env.update(overrides)
    return env


def run_script(
    name: str, *args: str, path_prefix: str = "", timeout: float = 120, **overrides: str
) -> subprocess.CompletedProcess:
    """Run deploy/<name> with the made-up cloud settings (plus `overrides`)."""
    return subprocess.run(
        [str(REPO / "deploy" / name), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=script_env(path_prefix, **overrides),
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def kubectl() -> str:
    return tool("kubectl")


def tiny_model(directory: Path) -> Path:
    """A randomly initialised tiny Llama in the production model layout."""
    return make_tiny_model_dir(directory)


def fake_cluster(tmp_path: Path, kubectl: str, cases: str = "") -> tuple[Path, Path]:
    """Stand-ins for az and kubectl (kustomize stays the real one) that log every call to
    calls.log; `cases` are extra `case "$*" in` branches for the kubectl stand-in."""
    log, bin_dir = tmp_path / "calls.log", tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "az").write_text(
        f'#!/bin/sh\necho "az $*" >> {log}\ncase "$*" in *"acr repository show"*) echo sha256:{"e" * 64} ;; esac\n'
    )
    (bin_dir / "kubectl").write_text(
        f'#!/bin/sh\n[ "$1" = kustomize ] && exec {kubectl} "$@"\necho "kubectl $*" >> {log}\n'
        f'case "$*" in\n{cases}esac\n'
    )
    for fake in bin_dir.iterdir():
        fake.chmod(0o755)
    return bin_dir, log


class JsonStandIn(BaseHTTPRequestHandler):
    """The handler of a stand-in HTTP server on 127.0.0.1: JSON answers, no request log."""

    def log_message(self, *args):  # quiet
        pass

    def answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
