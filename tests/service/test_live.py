"""The real thing: gunicorn with the production config on a free 127.0.0.1 port,
driven by the official `openai` client and raw sockets (disconnects, SIGTERM)."""

from __future__ import annotations

import ctypes.util
import http.client
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import openai
import pytest
import requests

from production_service.server import MALLOC_LIBRARIES, cpu_quota, serving_env, thread_env, wait_ready
from tests.conftest import make_tiny_model_dir
from tests.service.conftest import free_port, server_env, start_server

LONG_CONTEXT = 2048

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

AUTH = {"Authorization": "Bearer test-key"}


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="test-key", max_retries=0, timeout=30)


def metric(server, name: str) -> float:
    text = requests.get(f"{server.probe_url}/metrics", timeout=5).text  # the API port wants the key
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


def test_openai_client_plain_stream_n_and_stop(oai):
    [model] = oai.models.list().data
    assert model.id == "lmops-tiny"
    plain = oai.completions.create(
        model=model.id, prompt="ROMEO:", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    text = plain.choices[0].text
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 12

    chunks = list(
        oai.completions.create(
            model=model.id,
            prompt="ROMEO:",
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"

    many = oai.completions.create(model=model.id, prompt=["a", "b"], n=3, max_tokens=3, seed=1)
    assert sorted(c.index for c in many.choices) == list(range(6))

    stop = text.strip()[2:4] or text[2:4]
    stopped = oai.completions.create(
        model=model.id,
        prompt="ROMEO:",
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]

    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model.id, prompt="x", temperature=9)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=oai.base_url, api_key="wrong", max_retries=0).models.list()


def test_client_disconnect_mid_stream_aborts_and_frees_kv_blocks(server):
    aborted_before = (
        metric(server, 'lmops:request_success_total{finished_reason="abort"}')
        if "abort" in requests.get(f"{server.probe_url}/metrics").text
        else 0.0
    )
    url = urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    body = {"prompt": "ROMEO: " * 20, "max_tokens": 200, "stream": True, "ignore_eos": True}
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps(body),
        {**AUTH, "Content-Type": "application/json", "X-Request-ID": "gone-away"},
    )
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")
    assert metric(server, "lmops:num_requests_running") == 1
    assert metric(server, "lmops:kv_cache_usage_perc") > 0
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and metric(server, "lmops:num_requests_running") > 0:
        time.sleep(0.05)
    assert metric(server, "lmops:num_requests_running") == 0
    assert metric(server, "lmops:kv_cache_usage_perc") == 0
    assert metric(server, 'lmops:request_success_total{finished_reason="abort"}') == aborted_before + 1
    while time.monotonic() < deadline and not any(
        r["request_id"] == "gone-away" for r in server.access_records()
    ):
        time.sleep(0.05)
    [record] = [r for r in server.access_records() if r["request_id"] == "gone-away"]
    assert record["client_disconnected"] is True and record["completion_tokens"] < 200


def test_one_json_log_line_per_request_honouring_x_request_id(server):
    r = requests.post(
        f"{server.url}/v1/completions",
        json={"prompt": "ROMEO:", "max_tokens": 5},
        headers={**AUTH, "X-Request-ID": "trace-me-1"},
        timeout=30,
    )
    assert r.status_code == 200 and r.headers["X-Request-ID"] == "trace-me-1"
    requests.post(
        f"{server.url}/v1/completions",
        data="{",
        timeout=5,
        headers={**AUTH, "Content-Type": "application/json", "X-Request-ID": "trace-me-2"},
    )
    deadline = time.monotonic() + 5
    while (
        time.monotonic() < deadline
        and len([r for r in server.access_records() if r["request_id"].startswith("trace-me")]) < 2
    ):
        time.sleep(0.05)
    records = {r["request_id"]: r for r in server.access_records()}
    ok, bad = records["trace-me-1"], records["trace-me-2"]
    assert ok["status"] == 200 and ok["path"] == "/v1/completions"
    assert ok["prompt_tokens"] > 0 and 1 <= ok["completion_tokens"] <= 5
    assert 0 < ok["ttft_s"] <= ok["total_s"]
    assert (bad["status"], bad["error"]) == (400, "invalid_json")
    assert sum(1 for r in server.access_records() if r["request_id"] == "trace-me-1") == 1


def test_body_over_the_limit_is_413_through_gunicorn(server):
    r = requests.post(
        f"{server.url}/v1/completions",
        data=b"x" * (2 << 20),
        timeout=10,
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


@pytest.mark.timeout(180)
def test_sigterm_drains_in_flight_refuses_new_and_exits_0(tmp_path):
    # 1,000 tokens keep the stream in flight far longer than the 0.4 s this test waits
    # around SIGTERM on a quiet machine, and a 60 s drain lets them finish on a busy
    # one (a shared 2-core box generated 20 tokens/s).
    model_dir = make_tiny_model_dir(tmp_path / "long-context", max_seq_len=LONG_CONTEXT)
    server = start_server(model_dir, tmp_path / "drain.log", LMOPS_GRACEFUL_TIMEOUT="60")
    url = urlparse(server.url)
    stream = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    stream.request(
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "ROMEO:", "max_tokens": 1000, "stream": True, "ignore_eos": True}),
        {"Content-Type": "application/json"},
    )
    response = stream.getresponse()
    first = response.readline()
    keepalive = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    keepalive.request("GET", "/ready")
    assert keepalive.getresponse().read()
    time.sleep(0.2)  # parked as an idle keep-alive connection (gunicorn closes, not parks, after TERM)

    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    keepalive.request(
        "POST", "/v1/completions", json.dumps({"prompt": "late"}), {"Content-Type": "application/json"}
    )
    # Refused either way, never served: a 503 when the worker's poller still picked the request
    # up, or the idle connection closed when gunicorn had already left its loop (it stops
    # reading parked connections at TERM; which comes first is a race on a busy machine,
    # and clients treat a closed idle connection as a cue to go elsewhere).
    try:
        late = keepalive.getresponse()
    except (http.client.RemoteDisconnected, ConnectionResetError):
        late = None
    if late is not None:
        assert late.status == 503 and json.loads(late.read())["error"]["code"] == "shutting_down"

    rest = first + response.read()  # the in-flight stream runs to its end
    events = [e for e in rest.decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(90) == 0
    statuses = [r["status"] for r in server.access_records() if r["path"] == "/v1/completions"]
    assert statuses == ([200] if late is None else [503, 200])  # refused while the stream was in flight


def test_missing_model_stops_start_up_with_one_clear_line(tmp_path):
    server = start_server(tmp_path / "no-model", tmp_path / "fail.log", wait_ready=False)
    assert server.proc.wait(60) != 0
    lines = [line for line in server.log_lines() if "cannot load the model" in line]
    assert len(lines) == 1 and "no-model" in lines[0] and "config.json" in lines[0]
    assert "Traceback" not in server.log.read_text()


def test_concurrent_requests_share_the_batch(server):
    results = []

    def one(i):
        r = requests.post(
            f"{server.url}/predict", json={"prompt": f"line {i}", "max_tokens": 8}, headers=AUTH, timeout=60
        )
        results.append(r.status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 12


def test_serving_env_preloads_an_installed_allocator_unless_ld_preload_is_set(monkeypatch):
    """tcmalloc where installed (make system-tools installs it, as CI runs it); an LD_PRELOAD
    the caller set, even empty, is kept; with none of MALLOC_LIBRARIES installed, glibc's."""
    chosen = serving_env({})["LD_PRELOAD"]
    assert "tcmalloc" in chosen, chosen
    assert serving_env({"LD_PRELOAD": ""}) == {"LD_PRELOAD": ""}
    assert serving_env({"LD_PRELOAD": "libother.so", "A": "1"}) == {"LD_PRELOAD": "libother.so", "A": "1"}
    asked = []
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: asked.append(name))
    assert serving_env({"A": "1"}) == {"A": "1"}
    assert asked == list(MALLOC_LIBRARIES)


def test_thread_env_follows_the_cgroup_cpu_quota(tmp_path, monkeypatch):
    """cgroup v2's cpu.max, else v1's quota over period, rounded up; nothing without a quota,
    with one at or above the cores this process may use, or for a setting the caller made.
    (The image test runs the real thing: a container started with --cpus 1.)"""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cpu_quota(v2) == 2
    assert thread_env({}, v2) == {"OMP_NUM_THREADS": "2", "TORCHINDUCTOR_COMPILE_THREADS": "2"}
    assert thread_env({"OMP_NUM_THREADS": "4"}, v2) == {"TORCHINDUCTOR_COMPILE_THREADS": "2"}
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(v2) is None and thread_env({}, v2) == {}
    (v2 / "cpu.max").write_text("800000 100000\n")
    assert thread_env({}, v2) == {}  # all 8 cores: nothing to hold back
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_quota(v1) == 1 and thread_env({}, v1)["OMP_NUM_THREADS"] == "1"
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota(v1) is None
    assert cpu_quota(tmp_path / "none") is None


def test_lmops_serve_runs_outside_the_checkout(model_dir, tmp_path):
    """`lmops serve` needs no repository-relative path: the service is installed with lmops;
    its worker runs on the allocator serving_env preloads."""
    port, probe_port = free_port(), free_port()
    env = server_env(port, probe_port, LMOPS_GRACEFUL_TIMEOUT="5")
    lmops = Path(sys.executable).parent / "lmops"
    with (tmp_path / "serve.log").open("wb") as log:
        proc = subprocess.Popen(
            [str(lmops), "serve", "--model", str(model_dir)], cwd=tmp_path, env=env, stdout=log, stderr=log
        )
    try:
        assert wait_ready(f"http://127.0.0.1:{port}", proc, timeout=60), (tmp_path / "serve.log").read_text()
        r = requests.post(
            f"http://127.0.0.1:{port}/predict", json={"prompt": "ROMEO:", "max_tokens": 2}, timeout=30
        )
        assert r.status_code == 200 and r.json()["model"] == "lmops-tiny"
        [worker] = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        library = serving_env({})["LD_PRELOAD"].split(".so")[0]
        assert library in Path(f"/proc/{worker}/maps").read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_openai_client_chat_plain_and_streaming(oai):
    """The SDK's chat API as its documentation shows it, nothing patched."""
    messages = [{"role": "system", "content": "Speak verse."}, {"role": "user", "content": "ROMEO:"}]
    plain = oai.chat.completions.create(
        model="lmops-tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    [choice] = plain.choices
    assert choice.message.role == "assistant" and plain.object == "chat.completion"
    assert len(choice.logprobs.content) == plain.usage.completion_tokens
    stream = oai.chat.completions.create(
        model="lmops-tiny",
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="lmops-tiny", messages=[], max_tokens=1)
    assert err.value.body["param"] == "messages"
