"""What llm-d needs from a replica, through real gunicorn: KV-cache events of a served
prompt (a subscriber written from vLLM's types, on 127.0.0.1), request priorities (a 400
outside int64; per-priority queue metrics on /metrics), and bad event settings refused
at start in one line."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest
import requests

from production_service.app import OBJECTIVE_PRIORITY_HEADER
from tests.conftest import free_port
from tests.service.conftest import start_server
from tests.unit.engine.kv_subscriber import BlockStored, Subscriber

PROMPT = (
    "def total_count(items, index):\n    return items + index\nfor value in range(10):\n    data += value\n"
)


@pytest.fixture(scope="module")
def replica(model_dir, tmp_path_factory):
    port, replay_port = free_port(), free_port()
    sub = Subscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", topic="kv@")
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": "kv@pod-a@lmops-tiny",
    }
    server = start_server(
        model_dir,
        tmp_path_factory.mktemp("llm-d") / "server.log",
        LMOPS_KV_EVENTS_CONFIG=json.dumps(events),
        LMOPS_SCHEDULING_POLICY="priority",
    )
    yield server, sub
    server.stop()
    sub.close()


def test_a_served_prompt_reaches_the_subscriber_as_its_full_blocks(replica):
    server, sub = replica
    ids = requests.post(f"{server.url}/tokenize", json={"prompt": PROMPT}, timeout=30).json()["tokens"]
    r = requests.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    full = len(ids) // 16 * 16  # LMOPS_BLOCK_SIZE's default
    assert full >= 32

    def announced(s) -> list[int]:
        stored = [e for e in s.events() if isinstance(e, BlockStored)]
        return [t for e in stored for t in e.token_ids]

    sub.poll(lambda s: ids[:full] == announced(s)[-full:])
    assert sub.topics == {b"kv@pod-a@lmops-tiny"}
    assert not [line for line in server.log_lines() if "Traceback" in line]


def test_priority_reaches_the_engine_and_its_metrics(replica):
    server, _ = replica
    body = {"prompt": "def add(a, b):", "max_tokens": 2}
    r = requests.post(f"{server.url}/v1/completions", json={**body, "priority": 2**63}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    r = requests.post(f"{server.url}/v1/chat/completions", json={"messages": [], "priority": "1"}, timeout=30)
    assert r.status_code == 400
    r = requests.post(f"{server.url}/v1/completions", json={**body, "priority": -7}, timeout=30)
    assert r.status_code == 200, r.text
    metrics = requests.get(f"{server.probe_url}/metrics", timeout=10).text
    assert 'lmops:request_queue_time_by_priority_seconds_count{priority="-7"} 1.0' in metrics


def test_the_gateway_objective_priority_orders_the_request(replica):
    """The header the route sets per InferenceObjective (higher first) becomes the engine's
    priority (lower first), over the body's; a header that is not an int32 is a 400."""
    server, _ = replica
    body = {"prompt": "def add(a, b):", "max_tokens": 2, "priority": 3}
    r = requests.post(
        f"{server.url}/v1/completions", json=body, headers={OBJECTIVE_PRIORITY_HEADER: "10"}, timeout=30
    )
    assert r.status_code == 200, r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = requests.post(
        f"{server.url}/v1/chat/completions", json=chat, headers={OBJECTIVE_PRIORITY_HEADER: "-1"}, timeout=30
    )
    assert r.status_code == 200, r.text
    metrics = requests.get(f"{server.probe_url}/metrics", timeout=10).text
    assert 'lmops:request_queue_time_by_priority_seconds_count{priority="-10"} 1.0' in metrics
    assert 'lmops:request_queue_time_by_priority_seconds_count{priority="1"} 1.0' in metrics
    assert 'priority="3"}' not in metrics
    for bad in ("high", str(2**31)):
        r = requests.post(
            f"{server.url}/v1/completions", json=body, headers={OBJECTIVE_PRIORITY_HEADER: bad}, timeout=30
        )
        assert r.status_code == 400 and OBJECTIVE_PRIORITY_HEADER in r.json()["error"]["message"], r.text


def test_a_respawned_worker_publishes_on_the_same_endpoints(model_dir, tmp_path):
    """gunicorn replaces a worker that died: the new one binds the replay endpoint again
    and publishes from seq 0, starting with AllBlocksCleared (its cache is new), as a
    restarted vLLM does."""
    port, replay = free_port(), free_port()
    endpoints = (f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
    events = {"enable_kv_cache_events": True, "endpoint": endpoints[0], "replay_endpoint": endpoints[1]}
    server = start_server(model_dir, tmp_path / "server.log", LMOPS_KV_EVENTS_CONFIG=json.dumps(events))
    try:
        assert_publishes(server, endpoints)
        dead = server.worker_pid
        os.kill(dead, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not respawned(server, dead):
            assert time.monotonic() < deadline, "no ready worker within 60 s"
            time.sleep(0.2)
        assert_publishes(server, endpoints)
        assert not [line for line in server.log_lines() if "cannot bind" in line or "Traceback" in line]
    finally:
        server.stop()


def assert_publishes(server, endpoints: tuple[str, str]) -> None:
    """A new subscriber hears a served prompt's blocks, after a cache's first AllBlocksCleared."""
    sub = Subscriber(*endpoints)
    try:
        r = requests.post(
            f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=60
        )
        assert r.status_code == 200, r.text
        sub.poll(lambda s: any(isinstance(e, BlockStored) for e in s.events()))
        assert type(sub.events()[0]).__name__ == "AllBlocksCleared"
    finally:
        sub.close()


def respawned(server, dead: int) -> bool:
    """Another worker than `dead`, ready."""
    try:
        ready = requests.get(f"{server.probe_url}/ready", timeout=2).status_code == 200
        return server.worker_pid != dead and ready
    except (requests.RequestException, ValueError):  # between workers: no child, or no answer
        return False


def test_an_unknown_events_key_stops_the_start_in_one_line(model_dir, tmp_path):
    server = start_server(
        model_dir,
        tmp_path / "bad.log",
        wait_ready=False,
        LMOPS_KV_EVENTS_CONFIG='{"enable_kv_cache_events": true, "replay_endpoit": "tcp://*:5558"}',
    )
    assert server.proc.wait(60) != 0
    (line,) = [line for line in server.log_lines() if "LMOPS_KV_EVENTS_CONFIG" in line]
    assert "unknown key 'replay_endpoit'" in line
    assert "Traceback" not in server.log.read_text()


def test_an_endpoint_that_cannot_bind_stops_the_start_in_one_line(model_dir, tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
    events = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": endpoint}
    try:
        server = start_server(
            model_dir, tmp_path / "bind.log", wait_ready=False, LMOPS_KV_EVENTS_CONFIG=json.dumps(events)
        )
        assert server.proc.wait(60) != 0  # the worker exits with WORKER_BOOT_ERROR: the master halts
    finally:
        taken.close()
    (line,) = [line for line in server.log_lines() if "cannot bind" in line]
    assert endpoint in line and "Address already in use" in line
    assert "Traceback" not in server.log.read_text()


def test_the_probe_port_renders_prompts_for_the_token_producer(replica):
    """llm-d's token producer posts the request body to vLLM's render routes; the probe
    port answers without an API key, with the ids the engine would run."""
    server, _ = replica
    body = {"model": "lmops-tiny", "prompt": [PROMPT, "x = 1"], "max_tokens": 3, "priority": 2}
    r = requests.post(f"{server.probe_url}/v1/completions/render", json=body, timeout=30)
    assert r.status_code == 200, r.text
    for rendered, text in zip(r.json(), body["prompt"], strict=True):
        tokenized = requests.post(
            f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30
        )
        assert rendered == {"token_ids": tokenized.json()["tokens"]}
    messages = [{"role": "user", "content": PROMPT}]
    r = requests.post(
        f"{server.probe_url}/v1/chat/completions/render", json={"messages": messages}, timeout=30
    )
    tokenized = requests.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=30)
    assert r.status_code == 200 and r.json() == {"token_ids": tokenized.json()["tokens"]}
    r = requests.post(
        f"{server.probe_url}/v1/completions/render", json={"prompt": PROMPT, "bogus": 1}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "bogus"


def test_under_fcfs_the_document_and_the_api_allow_priority_0_only(client):
    """The default policy serves in arrival order: its /openapi.json says priority 0 only,
    and a request with another one is a 400 naming the field."""
    doc = client.get("/openapi.json").get_json()
    (field,) = doc["components"]["schemas"]["CompletionRequest"]["properties"]["priority"]["anyOf"][:1]
    assert (field["minimum"], field["maximum"]) == (0, 0)
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "priority": 3})
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "priority"
    headers = {OBJECTIVE_PRIORITY_HEADER: "10"}
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers=headers)
    assert r.status_code == 400 and "LMOPS_SCHEDULING_POLICY=priority" in r.get_json()["error"]["message"]
    assert (
        client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "priority": 0}).status_code
        == 200
    )
