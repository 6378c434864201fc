"""The promotion gate on live traffic, end to end: `lmops promote` with
promote.shadow_prometheus_url holds a candidate that passes on the test split as
@challenger; a real gunicorn replica following @champion and @challenger of the project's
registry mirrors its prompts to it; a real Prometheus scrapes them; the next promote reads
the comparison, promotes, and the replica swaps the new champion in. A Prometheus that
does not answer stops promote with one line and nothing written. (Each verdict of the
comparison on chosen numbers: tests/monitoring/test_shadow_gate.py.)"""

from __future__ import annotations

import json
import shutil
import time

import mlflow
import pytest
import requests

from tests.conftest import BIN, free_port, run, write_params
from tests.integration.test_cli import assert_clean_error
from tests.monitoring.conftest import prometheus  # noqa: F401 (the real-Prometheus fixture)
from tests.service.conftest import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def lmops(project, *args: str, **kw):
    return run([str(BIN / "lmops"), *args], project, **kw)


def promotion(project) -> dict:
    return json.loads((project / "artifacts/promotion.json").read_text())


def set_promote(project, **values) -> None:
    write_params(project, {"promote": values}, base=project / "params.yaml")


def aliases(project) -> dict[str, str]:
    uri = f"sqlite:///{project / 'mlflow.db'}"
    return dict(mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri).get_registered_model("lmops").aliases)


def served_version(server) -> str | None:
    r = requests.post(f"{server.url}/v1/completions", json={"prompt": "def f", "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text
    return r.headers.get("X-Model-Version")


def test_a_candidate_waits_as_challenger_then_wins_on_live_prompts(tokenized_project, tmp_path, prometheus):  # noqa: F811
    project = tmp_path / "repo"
    shutil.copytree(tokenized_project, project)
    write_params(project, {"train": {"max_steps": 4}}, base=project / "params.yaml")
    lmops(project, "train")
    lmops(project, "evaluate")
    lmops(project, "promote")
    assert promotion(project)["promoted"] and aliases(project) == {"champion": 1}
    write_params(project, {"train": {"max_steps": 60}}, base=project / "params.yaml")
    lmops(project, "train")
    lmops(project, "evaluate")

    # A Prometheus that does not answer: one line naming the key, nothing decided.
    set_promote(project, shadow_prometheus_url=f"http://127.0.0.1:{free_port()}")
    before = promotion(project)
    proc = lmops(project, "promote", check=False)
    assert_clean_error(proc, "promote.shadow_prometheus_url: cannot read the live comparison: no answer")
    assert promotion(project) == before and aliases(project) == {"champion": 1}

    # No mirrored prompts yet: better on the test split, so it waits as @challenger.
    empty = prometheus({"lmops": []})
    set_promote(project, shadow_prometheus_url=empty.url, min_shadow_prompts=10)
    lmops(project, "promote")
    waiting = promotion(project)
    assert not waiting["promoted"] and waiting["version"] == 2
    assert waiting["evidence"]["shadow"] == {
        "judged": False,
        "prompts": 0,
        "awaiting": True,
        "reason": "v2 as the challenger scored 0 mirrored prompts in the last 24h, "
        "fewer than promote.min_shadow_prompts=10",
    }
    assert "awaiting live evidence, v2 is @challenger meanwhile" in waiting["reason"]
    assert aliases(project) == {"champion": 1, "challenger": 2}

    uri = f"sqlite:///{project / 'mlflow.db'}"
    server = start_server(
        None,
        tmp_path / "server.log",
        LMOPS_MODEL_URI="models:/lmops@champion",
        LMOPS_CHALLENGER_URI="models:/lmops@challenger",
        LMOPS_SHADOW_SHARE="1",
        LMOPS_MODEL_POLL_S="0.5",
        LMOPS_MODEL_CACHE=str(tmp_path / "cache"),
        MLFLOW_TRACKING_URI=uri,
        MLFLOW_DISABLE_TELEMETRY="true",
    )
    try:
        prom = prometheus([server.probe_url.removeprefix("http://")])
        prom.targets_up()
        # Held-out lines, short enough for the tiny models' 64-token context.
        lines = [line[:80] for line in (project / "data/processed/test.txt").read_text().splitlines()]
        prompts = [line for line in lines if len(line) > 30][:12]
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
            assert requests.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        scored = 'sum(increase(lmops:shadow_prompt_bits_per_byte_count{role="challenger",challenger_version="2"}[24h]))'
        prom.wait_for(scored, lambda r: bool(r) and float(r[0]["value"][1]) >= 10)

        set_promote(project, shadow_prometheus_url=prom.url, min_shadow_prompts=10)
        lmops(project, "promote")
        won = promotion(project)
        live = won["evidence"]["shadow"]
        assert won["promoted"] and live["judged"] and live["passed"], won["reason"]
        assert live["prompts"] >= 10 and live["delta_bits_per_byte"] < 0
        assert f"live shadow: {live['reason']}" in won["reason"]
        numbers = json.loads((project / "artifacts/promotion_metrics.json").read_text())
        assert numbers["shadow_delta_bits_per_byte"] == live["delta_bits_per_byte"]
        assert aliases(project)["champion"] == 2

        deadline = time.monotonic() + 60
        while served_version(server) != "2":
            assert time.monotonic() < deadline, "the replica did not swap v2 in"
            time.sleep(0.5)
    finally:
        server.stop()
