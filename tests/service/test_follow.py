"""A live champion: real gunicorn replicas following `models:/lmops@champion` in a real
(SQLite) MLflow registry, or an export's `.current` link, swap each new version in
without a restart while clients stream; a corrupt version is refused, a registry that
fails is waited out; a challenger serves beside the champion and shadows its prompts."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from lmops.errors import LmopsError
from lmops.pipeline.scratch_registry import local_registry
from lmops.runtime.model_dir import WEIGHTS_FILE, export
from production_service import runtime as runtime_module
from production_service.model_source import CHAMPION, Source
from production_service.settings import ServiceConfig
from tests.conftest import free_port, make_tiny_model_dir
from tests.service.conftest import load_app, make_model_dir, start_server
from tests.unit.engine.kv_subscriber import BlockStored, Subscriber

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

POLL_S = "0.5"
HEADER = 100  # bytes of an SQLite file's header: a reader checks it before any page
STREAM = {"prompt": "ROMEO:", "max_tokens": 12, "stream": True, "ignore_eos": True}


def metrics(server) -> str:
    return requests.get(f"{server.probe_url}/metrics", timeout=5).text


def metric(server, name: str, **labels) -> float:
    """One sample of `name` with exactly `labels` (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in metrics(server).splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == (f"{name}{{{want}}}" if labels else name):
            return float(value)
    return 0.0


def served_version(server) -> str | None:
    r = requests.post(f"{server.url}/v1/completions", json={"prompt": "a b", "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text
    return r.headers.get("X-Model-Version")


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


def corrupt_copy(model_dir: Path, directory: Path) -> Path:
    """`model_dir` with bytes of its weights flipped: the size is right, the checksum is not."""
    bad = shutil.copytree(model_dir, directory)
    data = bytearray((bad / WEIGHTS_FILE).read_bytes())
    data[-64:] = bytes(b ^ 0xFF for b in data[-64:])
    (bad / WEIGHTS_FILE).write_bytes(bytes(data))
    return bad


@dataclass
class Streamers:
    """Clients streaming completions back to back until stopped; every answer is checked
    whole: a 200, one version in its header, one model in every event, every token asked
    for (finish_reason "length", not "abort"), [DONE] at the end."""

    url: str
    clients: int = 32
    answers: list[tuple[float, str | None]] = field(default_factory=list)  # (when the head came, version)
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Streamers:
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.clients)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _client(self) -> None:
        session = requests.Session()
        while not self.stop.is_set():
            try:
                r = session.post(f"{self.url}/v1/completions", json=STREAM, stream=True, timeout=60)
                head = time.monotonic()
                events = [line for line in r.iter_lines() if line]
                if r.status_code != 200 or events[-1] != b"data: [DONE]":
                    self.failures.append(f"{r.status_code}: {events[-3:]}")
                    continue
                chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
                finished = [
                    c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]
                ]
                if finished != ["length"]:  # an abort is a failure too
                    self.failures.append(f"a stream finished {finished}")
                if len({chunk["model"] for chunk in chunks}) != 1:
                    self.failures.append(f"one stream, several models: {chunks}")
                self.answers.append((head, r.headers.get("X-Model-Version")))
            except (requests.RequestException, ValueError) as exc:
                self.failures.append(repr(exc))

    def first(self, version: str, after: float) -> float | None:
        return next((t for t, v in list(self.answers) if v == version and t >= after), None)


@pytest.fixture(scope="module")
def registry(tmp_path_factory, model_dir):
    """The registry with lmops@champion at version 1 (`model_dir`) and a second model's
    version 2 registered but not yet champion."""
    root = tmp_path_factory.mktemp("registry")
    registry = local_registry(root)
    registry.register(model_dir, "champion")
    registry.register(make_model_dir(root / "second"))
    return registry


@pytest.fixture(scope="module")
def follower(registry, tmp_path_factory):
    root = tmp_path_factory.mktemp("follower")
    server = start_server(
        None,
        root / "server.log",
        LMOPS_MODEL_URI="models:/lmops@champion",
        LMOPS_MODEL_CACHE=str(root / "cache"),
        LMOPS_MODEL_POLL_S=POLL_S,
        MLFLOW_TRACKING_URI=registry.uri,
        MLFLOW_DISABLE_TELEMETRY="true",
    )
    yield server
    server.stop()


def test_a_promote_under_32_streams_drops_nothing_and_keeps_the_process(registry, follower):
    master, worker = follower.proc.pid, follower.worker_pid
    assert served_version(follower) == "1"
    with Streamers(follower.url) as streams:
        wait_for(lambda: len(streams.answers) >= 32, 60, "32 answers from version 1")
        moved = time.monotonic()
        registry.move("champion", 2)
        first = wait_for(lambda: streams.first("2", moved), 20, "an answer from version 2")
        wait_for(lambda: streams.first("2", first + 1), 20, "a second more of version 2's answers")
    assert streams.failures == []
    assert first - moved < 10, f"version 2 answered {first - moved:.1f} s after the alias moved"
    assert {v for _, v in streams.answers} == {"1", "2"}
    assert (follower.proc.pid, follower.worker_pid) == (master, worker) and follower.proc.poll() is None
    assert metric(follower, "lmops:model_swaps_total", role="champion") == 1
    assert metric(follower, "lmops:model_info", role="champion", model="lmops", version="2") == 1
    assert metric(follower, "lmops:model_info", role="champion", model="lmops", version="1") == 0
    wait_for(lambda: any("retired lmops" in line for line in follower.log_lines()), 30, "version 1 retired")


def test_a_failing_registry_is_waited_out_logged_once(registry, follower):
    db = Path(registry.uri.removeprefix("sqlite:///"))
    good = db.read_bytes()
    errors = metric(follower, "lmops:model_poll_errors_total", role="champion")
    with db.open("r+b") as f:  # the store fails under the live connection: every look errors
        f.write(b"\0" * len(good))
    try:
        wait_for(
            lambda: metric(follower, "lmops:model_poll_errors_total", role="champion") >= errors + 3,
            20,
            "three failed looks",
        )
        assert served_version(follower) == "2"
    finally:
        with db.open("r+b") as f:  # the header last: no look reads half-restored pages as valid
            f.seek(HEADER)
            f.write(good[HEADER:])
            f.seek(0)
            f.write(good[:HEADER])
    wait_for(lambda: any("answers again" in line for line in follower.log_lines()), 20, "the registry back")
    logged = [line for line in follower.log_lines() if "cannot look for a new version" in line]
    assert (
        len(logged) == 1
        and "file is not a database" in logged[0]
        and "Traceback" not in follower.log.read_text()
    )


def test_a_corrupt_version_is_refused_and_the_next_good_one_wins(registry, follower, model_dir, tmp_path):
    serving = served_version(follower)
    bad = registry.register(corrupt_copy(model_dir, tmp_path / "bad"), "champion")
    wait_for(lambda: metric(follower, "lmops:model_swaps_refused_total", role="champion") == 1, 30, "refused")
    assert served_version(follower) == serving
    [line] = [line for line in follower.log_lines() if "refused" in line]
    assert f"new version {bad.version}" in line and "corrupt weights file" in line
    time.sleep(4 * float(POLL_S))  # a refused version is not tried again
    assert metric(follower, "lmops:model_swaps_refused_total", role="champion") == 1
    # two promotes in quick succession: the later one ends up serving
    registry.register(model_dir, "champion")
    last = str(registry.register(model_dir, "champion").version)
    wait_for(lambda: served_version(follower) == last, 30, f"version {last} serving")
    time.sleep(4 * float(POLL_S))
    assert served_version(follower) == last
    info = [line for line in metrics(follower).splitlines() if line.startswith("lmops:model_info{")]
    assert info == [f'lmops:model_info{{model="lmops",role="champion",version="{last}"}} 1.0']


def test_an_export_is_followed_through_its_link(model_dir, tmp_path):
    """docker compose's case: promote exports into the mounted directory and the replica
    notices `.current` moving; no restart."""
    target = tmp_path / "export"
    export(model_dir, target, model_name="lmops", model_version=1)
    server = start_server(target, tmp_path / "server.log", LMOPS_MODEL_POLL_S=POLL_S)
    try:
        worker = server.worker_pid
        assert served_version(server) == "1"
        moved = time.monotonic()
        export(model_dir, target, model_name="lmops", model_version=2)
        wait_for(lambda: served_version(server) == "2", 10, "version 2 serving")
        assert time.monotonic() - moved < 10 and server.worker_pid == worker
        assert metric(server, "lmops:model_swaps_total", role="champion") == 1
    finally:
        server.stop()


def test_a_swap_hands_the_kv_events_to_the_new_version(model_dir, tmp_path):
    """llm-d's subscriber on a replica that follows its export, a challenger beside it:
    the new version publishes on the endpoint the replica bound once, what the old one
    announced is cleared, and the challenger's cache is never announced."""
    port, replay = free_port(), free_port()
    sub = Subscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
    }
    target = tmp_path / "export"
    export(model_dir, target, model_name="lmops", model_version=1)
    server = start_server(
        target,
        tmp_path / "server.log",
        LMOPS_MODEL_POLL_S=POLL_S,
        LMOPS_KV_EVENTS_CONFIG=json.dumps(events),
        LMOPS_CHALLENGER_DIR=str(model_dir),
    )

    def serve(prompt: str, model: str | None = None) -> list[int]:
        """The prompt's full blocks' token ids, once its completion is answered."""
        body = {"prompt": prompt, "max_tokens": 1, **({"model": model} if model else {})}
        r = requests.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        ids = requests.post(f"{server.url}/tokenize", json={"prompt": prompt}, timeout=5).json()["tokens"]
        return ids[: len(ids) // 16 * 16]  # LMOPS_BLOCK_SIZE's default

    def since_last_clear() -> list:
        kinds = [type(e).__name__ for e in sub.events()]
        last = len(kinds) - 1 - kinds[::-1].index("AllBlocksCleared")
        return sub.events()[last + 1 :]

    def announced(events) -> list[int]:
        return [t for e in events if isinstance(e, BlockStored) for t in e.token_ids]

    try:
        old = serve("for item in range(10):\n    total = total + item * index\n" * 2)
        sub.poll(lambda s: announced(s.events())[-len(old) :] == old)  # after the warm-up's
        export(model_dir, target, model_name="lmops", model_version=2)
        wait_for(lambda: served_version(server) == "2", 20, "version 2 serving")
        serve("SELECT name, count FROM items WHERE id = 1 ORDER BY name;\n" * 2, "lmops-tiny@challenger")
        new = serve("def total(items):\n    return sum(item.count for item in items)\n" * 2)
        sub.poll(lambda s: announced(since_last_clear()) == new)
        assert sub.topics == {b""} and not [line for line in server.log_lines() if "Traceback" in line]
    finally:
        server.stop()
        sub.close()


def test_a_retired_version_is_freed_before_the_heap_is_trimmed(model_dir, tmp_path, monkeypatch):
    """After a swap nothing keeps the old engine (the retiring thread's own arguments
    included), so the trim that follows hands its memory back to the system."""
    target = tmp_path / "export"
    export(model_dir, target, model_name="lmops", model_version=1)
    runtime = load_app(model_dir=target, device="cpu", model_poll_s=0).extensions["lmops"]  # swapped by hand
    try:
        old = weakref.ref(runtime.champion.engine)
        trims = []
        monkeypatch.setattr(
            runtime_module, "_LIBC", SimpleNamespace(malloc_trim=lambda _: trims.append(old()))
        )
        export(model_dir, target, model_name="lmops", model_version=2)
        assert runtime.swap(runtime.sources[CHAMPION], "2")
        assert runtime.champion.model.version == "2"
        wait_for(lambda: trims, 30, "version 1 retired")
        assert trims == [None]
    finally:
        runtime.shutdown(5)


def test_what_moves_is_followed_and_a_version_number_never_moves(model_dir, tmp_path):
    export(model_dir, tmp_path / "export", model_version=1)
    follows = {
        "models:/lmops@champion": True,
        "models:/lmops/3": False,  # pinned by number
        "runs:/abc/model": False,
    }
    for uri, want in follows.items():
        assert Source(CHAMPION, None, uri).follows is want, uri
    assert Source(CHAMPION, tmp_path / "export").follows  # its .current link
    assert not Source(CHAMPION, model_dir).follows  # a plain directory


def test_a_challenger_with_its_own_tokenizer_serves_and_shadows(model_dir, tmp_path):
    """Half the champion's prompts mirrored: both models score the same ones."""
    text = "\n".join(f"SELECT c{i} FROM t{i % 7} WHERE id = {i};" for i in range(600))
    meta = {"model_name": "lmops", "model_version": 9}
    challenger = make_tiny_model_dir(tmp_path / "challenger", meta=meta, text=text)
    server = start_server(
        model_dir, tmp_path / "server.log", LMOPS_CHALLENGER_DIR=str(challenger), LMOPS_SHADOW_SHARE="0.5"
    )
    try:
        models = requests.get(f"{server.url}/v1/models", timeout=5).json()["data"]
        assert [(m["id"], m["version"]) for m in models] == [("lmops-tiny", "7"), ("lmops@challenger", "9")]
        body = {"prompt": "ROMEO: what light", "max_tokens": 4}
        r = requests.post(
            f"{server.url}/v1/completions", json={**body, "model": "lmops@challenger"}, timeout=30
        )
        assert r.status_code == 200 and r.json()["model"] == "lmops@challenger"
        assert r.headers["X-Model-Version"] == "9"
        tokens = {
            m["id"]: requests.post(
                f"{server.url}/tokenize", json={"prompt": body["prompt"], "model": m["id"]}, timeout=5
            ).json()["tokens"]
            for m in models
        }
        assert tokens["lmops-tiny"] != tokens["lmops@challenger"]  # two tokenizers
        for _ in range(20):
            r = requests.post(f"{server.url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 200 and r.json()["model"] == "lmops-tiny"
        name = "lmops:shadow_prompt_bits_per_byte_count"
        scored_by = {"challenger_model": "lmops", "challenger_version": "9"}  # the series say by whom
        wait_for(
            lambda: metric(server, name, role="challenger", **scored_by) == 10,
            20,
            "ten mirrored prompts scored",
        )
        assert metric(server, name, role="champion", **scored_by) == 10
        assert metric(server, "lmops:shadow_prompts_dropped_total") == 0
        sums = [
            metric(server, "lmops:shadow_prompt_bits_per_byte_sum", role=r, **scored_by)
            for r in ("champion", "challenger")
        ]
        assert all(s > 0 for s in sums) and sums[0] != sums[1]
        assert any(
            re.search(r"memory: champion \d+ MiB.*challenger \d+ MiB", line) for line in server.log_lines()
        )
        r = requests.post(f"{server.url}/v1/completions", json={**body, "model": "nope"}, timeout=5)
        assert r.status_code == 404 and "'lmops@challenger'" in r.json()["error"]["message"]
    finally:
        server.stop()


def test_shadow_mode_without_a_challenger_is_one_line(monkeypatch):
    monkeypatch.setenv("LMOPS_SHADOW_SHARE", "0.1")
    with pytest.raises(
        LmopsError, match="^LMOPS_SHADOW_SHARE: shadow_share mirrors prompts to the challenger"
    ):
        ServiceConfig.from_env()
    monkeypatch.setenv("LMOPS_CHALLENGER_DIR", os.devnull)
    assert ServiceConfig.from_env().shadow_share == 0.1
