"""docker-compose.yml: valid against the Compose specification's JSON schema (the
copy check-jsonschema ships, offline), and the stack the docs promise."""

from __future__ import annotations

import subprocess

import yaml

from tests.deploy.conftest import REPO, tool

COMPOSE = REPO / "docker-compose.yml"


def check_compose(path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_compose_file_matches_the_compose_specification():
    proc = check_compose(COMPOSE)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_schema_check_rejects_an_invalid_file(tmp_path):
    broken = yaml.safe_load(COMPOSE.read_text())
    broken["services"]["lmops"]["healthcheck"] = {"test": ["CMD", "true"], "intervall": "5s"}
    (tmp_path / "docker-compose.yml").write_text(yaml.safe_dump(broken))
    assert check_compose(tmp_path / "docker-compose.yml").returncode != 0


def test_stack_tracking_server_then_service_on_5001_and_a_gpu_profile():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    mlflow, cpu, gpu = services["mlflow"], services["lmops"], services["lmops-gpu"]

    command = " ".join(mlflow["command"])
    assert "--backend-store-uri=sqlite:////mlflow/" in command and "--serve-artifacts" in command
    assert any(v.endswith(":/mlflow") for v in mlflow["volumes"]), "the store is not on a volume"
    assert "/health" in " ".join(mlflow["healthcheck"]["test"])

    for service in (cpu, gpu):
        assert service["depends_on"]["mlflow"]["condition"] == "service_healthy"
        assert service["environment"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
        assert service["read_only"] is True and "/tmp" in service["tmpfs"]
        # loopback unless told otherwise: no key is the default
        assert [p for p in service["ports"] if p.endswith(":5001")][0].startswith("${LMOPS_BIND:-127.0.0.1}:")
    assert "${LMOPS_BIND:-127.0.0.1}:${LMOPS_PORT:-5001}:5001" in cpu["ports"]
    assert "profiles" not in cpu and gpu["profiles"] == ["gpu"]
    assert gpu["build"]["args"]["VARIANT"] == "cuda" and gpu["environment"]["LMOPS_DEVICE"] == "cuda"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
