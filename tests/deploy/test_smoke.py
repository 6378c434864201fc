"""deploy/smoke_test.sh for real: against a stand-in server (its checks), and against
the service itself under gunicorn, started exactly as the image starts it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from http.server import ThreadingHTTPServer

import pytest

from production_service.server import gunicorn_argv, serving_env, wait_ready
from tests.conftest import free_port
from tests.deploy.conftest import REPO, SECRETS, JsonStandIn, run_script, tiny_model


class StandIn(JsonStandIn):
    completion: dict = {"choices": [{"text": "return 1", "index": 0}]}

    def do_GET(self):
        if self.path in ("/health", "/ready"):
            self.answer(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self.answer(200, {"object": "list", "data": [{"id": "lmops", "object": "model"}]})
        else:
            self.answer(404, {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        authorized = self.headers.get("Authorization") == f"Bearer {SECRETS['LMOPS_API_KEY']}"
        if self.path != "/v1/completions" or not authorized or body.get("model") != "lmops":
            self.answer(401 if not authorized else 400, {"error": {"message": "no"}})
        else:
            self.answer(200, type(self).completion)


@pytest.fixture
def stand_in():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_smoke_test_passes_on_a_good_answer(stand_in):
    proc = run_script("smoke_test.sh", stand_in, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "completion: 'return 1'" in proc.stdout and "smoke test passed" in proc.stderr
    assert SECRETS["LMOPS_API_KEY"] not in proc.stdout + proc.stderr


def test_smoke_test_fails_on_a_wrong_answer_or_a_refusal(stand_in, monkeypatch):
    monkeypatch.setattr(StandIn, "completion", {"choices": []})
    assert run_script("smoke_test.sh", stand_in, timeout=60).returncode != 0
    monkeypatch.setattr(StandIn, "completion", {"choices": [{"text": "x"}]})
    assert run_script("smoke_test.sh", stand_in, timeout=60, LMOPS_API_KEY="wrong-key").returncode != 0


@pytest.mark.slow
def test_smoke_test_against_the_real_service_under_gunicorn(tmp_path):
    model = tiny_model(tmp_path / "model")
    port = free_port()
    env = {
        **os.environ,
        "HOST": "127.0.0.1",
        "PORT": str(port),
        "LMOPS_PROBE_PORT": str(free_port()),
        "LMOPS_MODEL_DIR": str(model),
        "LMOPS_API_KEY": SECRETS["LMOPS_API_KEY"],
        "LMOPS_DEVICE": "cpu",
        "LMOPS_GRACEFUL_TIMEOUT": "5",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("LMOPS_MODEL_URI", None)
    log = tmp_path / "gunicorn.log"
    with log.open("wb") as out:  # started as the image starts it
        server = subprocess.Popen(
            gunicorn_argv(), cwd=REPO, env=serving_env(env), stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_ready(url, server, timeout=120):
            pytest.fail(f"gunicorn did not become ready:\n{log.read_text()[-3000:]}")
        proc = run_script("smoke_test.sh", url, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr + log.read_text()[-3000:]
        assert "completion:" in proc.stdout
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
