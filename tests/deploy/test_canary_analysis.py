"""The canary analysis (deploy/canary/analysistemplate.yaml) on a real Prometheus that
scrapes real gunicorn services: one stable version and four canaries, a healthy one
and three started faulty on purpose (LMOPS_FAULT_*, or a model whose promised bits/byte
do not hold on live prompts). The template's own PromQL, with its args substituted,
judged as Argo Rollouts judges it (deploy/canary_analysis.py): the healthy canary
passes every metric, each faulty one fails its metric, a canary without data is
inconclusive, and a Prometheus that went away makes the analysis an error: no
promotion."""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time

import pytest
import requests

from tests.deploy.test_canary import analysis_module
from tests.monitoring.conftest import prometheus  # noqa: F401 (the real-Prometheus fixture)
from tests.service.conftest import SHAKESPEARE, make_model_dir, start_server

pytestmark = pytest.mark.slow

REFERENCE = 8.0  # bits/byte the stable model "promised" (a random model scores about that)
# What each canary is, as the environment of its server (None: the stable model dir).
CANARIES = {
    "healthy": {},
    "failing": {"LMOPS_FAULT_ERROR_RATE": "0.5"},
    "slow": {"LMOPS_FAULT_STEP_DELAY": "1.0"},
    "drifting": {"model": REFERENCE / 2},  # promises twice better than it does on live text
}
# The verdict per canary and metric; "-" is not checked (a failing canary is also fast).
EXPECTED = {
    "healthy": {"error-ratio": "Successful", "ttft-p95": "Successful", "prompt-drift": "Successful"},
    "failing": {"error-ratio": "Failed", "ttft-p95": "-", "prompt-drift": "-"},
    "slow": {"error-ratio": "Successful", "ttft-p95": "Failed", "prompt-drift": "Successful"},
    "drifting": {"error-ratio": "Successful", "ttft-p95": "Successful", "prompt-drift": "Failed"},
}
WINDOW = "20s"
# This shared 2-core test box is slower and noisier than a pod: compare TTFTs above
# half a second (the template's default floor is 0.1 s); the slow canary adds 1 s.
ARGS = {"namespace": "", "version-label": "job", "stable-hash": "stable", "window": WINDOW}
ARGS["ttft-p95-floor-seconds"] = "0.5"


def model_with_reference(source, target, reference: float):
    shutil.copytree(source, target)
    meta = json.loads((target / "lmops.json").read_text())
    (target / "lmops.json").write_text(json.dumps({**meta, "metrics": {"test_bits_per_byte": reference}}))
    return target


def drive(url: str, prompts: list[str], until: float) -> None:
    """Steady completions traffic, one request at a time."""
    i = 0
    while time.monotonic() < until:
        with contextlib.suppress(requests.RequestException):
            body = {"prompt": prompts[i % len(prompts)], "max_tokens": 4}
            requests.post(f"{url}/v1/completions", json=body, timeout=60)
        i += 1


def test_the_analysis_passes_a_healthy_canary_and_stops_each_faulty_one(tmp_path, prometheus):  # noqa: F811
    ca = analysis_module()
    base = make_model_dir(tmp_path / "model")
    stable_dir = model_with_reference(base, tmp_path / "stable", REFERENCE)
    env = {"LMOPS_DRIFT_SAMPLE": "1", "OMP_NUM_THREADS": "1"}
    servers = {"stable": start_server(stable_dir, tmp_path / "stable.log", **env)}
    try:
        for name, setting in CANARIES.items():
            setting = dict(setting)
            reference = setting.pop("model", None)
            model = (
                stable_dir if reference is None else model_with_reference(base, tmp_path / name, reference)
            )
            servers[name] = start_server(model, tmp_path / f"{name}.log", **env, **setting)
        prom = prometheus({name: [srv.url.removeprefix("http://")] for name, srv in servers.items()})
        prom.targets_up()
        text = SHAKESPEARE.read_text()[:40_000] if SHAKESPEARE.is_file() else None
        lines = [line for line in (text or "").splitlines() if len(line) > 30]
        prompts = lines[::50][:40] or [f"def f{i}(x):\n    return x * {i}" for i in range(40)]
        until = time.monotonic() + 22  # the window and two scrapes
        threads = [threading.Thread(target=drive, args=(srv.url, prompts, until)) for srv in servers.values()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        for name, expected in EXPECTED.items():
            for metric in ca.load(ca.TEMPLATE, {**ARGS, "canary-hash": name}):
                result = ca.query(prom.url, metric.query)
                if expected[metric.name] != "-":
                    assert ca.judge(metric, result) == expected[metric.name], (
                        f"{name} {metric.name}: {result}"
                    )

        # The whole analysis through its command line: promote the healthy canary only.
        def analysis(canary: str, url: str = prom.url) -> int:
            argv = ["--prometheus", url, "--count", "2", "--interval", "0"]  # 2 > failureLimit
            for key, value in {**ARGS, "canary-hash": canary}.items():
                argv += ["--arg", f"{key}={value}"]
            return ca.main(argv)

        assert analysis("healthy") == 0
        assert analysis("failing") == 1
        assert analysis("not-deployed") == 3  # no data: inconclusive, not promoted
        prom.stop()
        assert analysis("healthy") == 3  # Prometheus gone: an error, not promoted
    finally:
        for srv in servers.values():
            srv.stop()
