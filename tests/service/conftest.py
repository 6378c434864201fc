"""Fixtures for the service tests: a tiny model directory, an in-process app on
it (Flask's test client), and real gunicorn servers on free 127.0.0.1 ports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from production_service.app import create_app
from production_service.server import gunicorn_argv, serving_env
from production_service.server import wait_ready as server_ready
from production_service.settings import ServiceConfig
from tests.conftest import free_port, make_tiny_model_dir

REPO = Path(__file__).resolve().parents[2]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
CONTEXT = 256


def make_model_dir(directory: Path) -> Path:
    """A randomly initialised tiny Llama in the HF layout, with lmops.json facts."""
    text = SHAKESPEARE.read_text()[:20_000] if SHAKESPEARE.is_file() else None
    meta = {"run_id": "run-tiny", "model_name": "lmops-tiny", "model_version": "7"}
    return make_tiny_model_dir(directory, max_seq_len=CONTEXT, meta=meta, text=text)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("service-model"))


def load_app(**config):
    app = create_app(ServiceConfig(**config))
    assert app.extensions["lmops"].wait_ready(60), app.extensions["lmops"].error
    return app


@pytest.fixture(scope="session")
def app(model_dir):
    """One loaded app shared by the in-process tests (loading is the slow part)."""
    app = load_app(model_dir=model_dir, device="cpu", max_body_bytes=64 * 1024)
    yield app
    app.extensions["lmops"].shutdown(5)


@pytest.fixture
def client(app):
    return app.test_client()


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path
    probe_url: str

    @property
    def worker_pid(self) -> int:
        """gunicorn's one worker process."""
        [pid] = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        return int(pid)

    def log_lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()

    def access_records(self) -> list[dict]:
        return [json.loads(line) for line in self.log_lines() if line.startswith("{")]

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def server_env(port: int, probe_port: int, **env: str) -> dict[str, str]:
    """A test replica's environment: loopback, its own free ports, CPU, a short drain."""
    return {
        **os.environ,
        "HOST": "127.0.0.1",
        "PORT": str(port),
        "LMOPS_PROBE_PORT": str(probe_port),
        "LMOPS_DEVICE": "cpu",
        "LMOPS_GRACEFUL_TIMEOUT": "10",
        **env,
    }


def start_server(model_dir: Path | None, log: Path, wait_ready: bool = True, **env: str) -> Server:
    port, probe_port = free_port(), free_port()
    full_env = server_env(port, probe_port, **env)
    if model_dir is not None:
        full_env["LMOPS_MODEL_DIR"] = str(model_dir)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            gunicorn_argv(), cwd=REPO, env=serving_env(full_env), stdout=out, stderr=subprocess.STDOUT
        )
    server = Server(f"http://127.0.0.1:{port}", proc, log, f"http://127.0.0.1:{probe_port}")
    if wait_ready and not server_ready(server.url, proc, timeout=60):
        server.stop(5)
        raise AssertionError("server did not become ready:\n" + "\n".join(server.log_lines()[-30:]))
    return server


@pytest.fixture(scope="session")
def server(model_dir, tmp_path_factory):
    """One real gunicorn replica, with an API key, shared by the live tests."""
    srv = start_server(model_dir, tmp_path_factory.mktemp("server") / "server.log", LMOPS_API_KEY="test-key")
    yield srv
    srv.stop()
