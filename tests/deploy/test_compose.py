"""docker-compose.yml: valid against the Compose specification's JSON schema (the
copy check-jsonschema ships, offline), and the stack the docs promise."""

from __future__ import annotations

import re
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

    assert "/health" in " ".join(mlflow["healthcheck"]["test"])

    for service in (cpu, gpu):
        assert service["depends_on"]["mlflow"]["condition"] == "service_healthy"
        assert service["environment"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
        assert service["read_only"] is True and "/tmp" in service["tmpfs"]
        # the decode graphs' compile cache outlives the container (the image test runs it)
        assert "compile-cache:/var/cache/lmops" in service["volumes"]
        assert service["environment"]["TORCHINDUCTOR_CACHE_DIR"].startswith("/var/cache/lmops/")
        # loopback unless told otherwise: no key is the default
        assert [p for p in service["ports"] if p.endswith(":5001")][0].startswith("${LMOPS_BIND:-127.0.0.1}:")
    assert "${LMOPS_BIND:-127.0.0.1}:${LMOPS_PORT:-5001}:5001" in cpu["ports"]
    assert "profiles" not in cpu and gpu["profiles"] == ["gpu"]
    assert gpu["build"]["args"]["VARIANT"] == "cuda" and gpu["environment"]["LMOPS_DEVICE"] == "cuda"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


def test_mlflow_on_postgres_and_s3_with_credentials_from_an_uncommitted_env_file():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    mlflow, postgres, storage, bucket = (
        services[n] for n in ("mlflow", "postgres", "storage", "create-bucket")
    )
    command, env = " ".join(mlflow["command"]), mlflow["environment"]
    assert env["MLFLOW_BACKEND_STORE_URI"].startswith(
        "postgresql+psycopg2://mlflow:${POSTGRES_PASSWORD}@postgres:"
    )
    assert (
        "--artifacts-destination=s3://" in command and env["MLFLOW_S3_ENDPOINT_URL"] == "http://storage:9000"
    )
    assert "mlflow:5000" in command.split("--allowed-hosts=")[1].split(",")  # the service's Host header
    assert mlflow["depends_on"] == {
        "postgres": {"condition": "service_healthy"},
        "storage": {"condition": "service_healthy"},
        "create-bucket": {"condition": "service_completed_successfully"},
    }
    assert "create-bucket" in " ".join(bucket["entrypoint"]) and bucket["restart"] == "no"
    for service in (postgres, storage, mlflow):
        assert service["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL")
    # The bucket's keys stay on the server side: the service downloads through MLflow's proxy.
    assert not {k for k in services["lmops"]["environment"] if k.startswith("AWS_")}
    assert "${S3_SECRET_ACCESS_KEY" in storage["environment"]["RUSTFS_SECRET_KEY"]

    # Every secret is interpolated from .env, which neither git nor the image build sees;
    # .env.example names each one compose requires.
    text = COMPOSE.read_text()
    required = set(re.findall(r"\$\{([A-Z0-9_]+):\?", text))
    assert required == {"POSTGRES_PASSWORD", "S3_ACCESS_KEY_ID", "S3_SECRET_ACCESS_KEY"}
    example = dict(
        line.split("=", 1)
        for line in (REPO / ".env.example").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    assert required <= set(example)
    assert "/.env" in (REPO / ".gitignore").read_text().splitlines()
    assert ".env" in (REPO / ".dockerignore").read_text().splitlines()
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith(("127.0.0.1:", "${LMOPS_BIND:-127.0.0.1}:")), (name, port)
