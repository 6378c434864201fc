"""A real Prometheus scraping a real gunicorn service (a champion and a shadowing challenger):
the recording rules and every dashboard query return data, and the drift alert stays silent for held-out text, then goes pending
when the prompts turn into another kind of text."""

from __future__ import annotations

import time

import pytest
import requests

from deploy.monitoring import check
from tests.monitoring.conftest import RULES
from tests.monitoring.drift_prompts import in_distribution, out_of_distribution
from tests.service.conftest import start_server

pytestmark = pytest.mark.slow


def complete(url: str, prompt, max_tokens: int = 3) -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return requests.post(f"{url}/v1/completions", json=body, timeout=60).status_code


def drift_alerts(prom) -> list[dict]:
    return prom.alerts("LmopsPromptDrift")


def test_rules_dashboard_and_drift_alert_on_a_real_prometheus(prometheus, trained_model, tmp_path):
    from tokenizers import Tokenizer

    # The model is its own challenger, shadowing every prompt: the shadow rules and panels have data.
    server = start_server(
        trained_model.path,
        tmp_path / "server.log",
        LMOPS_DRIFT_SAMPLE="1",
        LMOPS_CHALLENGER_DIR=str(trained_model.path),
        LMOPS_SHADOW_SHARE="1",
    )
    try:
        prom = prometheus([server.probe_url.removeprefix("http://")])  # as deployed: the probe port
        prom.targets_up()
        # Held-out text (what the reference was measured on), one bad request, a few decodes.
        for prompt in in_distribution(trained_model.test_text, 12):
            assert complete(server.url, prompt) == 200
        assert (
            requests.post(f"{server.url}/v1/completions", json={"prompt": 7}, timeout=10).status_code == 400
        )

        recorded = sorted(check.recorded_names(RULES))
        for name in recorded:
            prom.wait_for(name)
        for _, title, expr in check.dashboard_queries(check.DASHBOARD):
            assert prom.wait_for(check.expand(expr)), title

        ref = prom.value("job:lmops_model_reference_bits_per_byte:max")
        assert ref == pytest.approx(trained_model.reference_bits_per_byte)
        live = prom.value("job:lmops_prompt_bits_per_byte:p50_15m")
        assert live < prom.value("job:lmops_drift_threshold_bits_per_byte:max")
        # Silent for held-out text: several evaluations with the median below the threshold.
        for _ in range(4):  # rules are evaluated every second
            assert drift_alerts(prom) == []
            time.sleep(1)

        # Other kinds of text, more of them than the held-out prompts: the median moves up.
        tokenizer = Tokenizer.from_file(str(trained_model.path / "tokenizer.json"))
        ood = out_of_distribution(trained_model.test_text, tokenizer, n=10)
        for prompt in ood["german"] + ood["random"] + ood["shuffled"]:
            assert complete(server.url, prompt, max_tokens=1) == 200
        prom.wait_for('ALERTS{alertname="LmopsPromptDrift"}', timeout=60)
        [alert] = drift_alerts(prom)
        assert alert["state"] == "pending"  # for: 30m before it fires
        assert alert["labels"]["action"] == "retrain" and alert["labels"]["job"] == "lmops"
        assert prom.value("job:lmops_prompt_bits_per_byte:p50_15m") > 1.5 * ref
    finally:
        assert server.stop() == 0
