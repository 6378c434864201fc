"""The app in-process (Flask's test client) on a tiny random model: the
OpenAI-compatible shapes, every client error as a 4xx in OpenAI's shape, and
the states around the model (loading, failed, full queue, shutting down)."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from lmops.errors import LmopsError
from lmops.runtime.engine import EngineConfig, SamplingParams
from lmops.runtime.engine.config import KVEventsConfig
from production_service import app as app_module
from production_service import settings as settings_module
from production_service.app import create_app
from production_service.settings import ServiceConfig
from tests.service.conftest import CONTEXT, load_app

PROMPT = "ROMEO: What light"


def completion(client, **body):
    return client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, **body})


def assert_error(response, status: int, code: str | None = None, param: str | None = None):
    assert response.status_code == status, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param, error
    return error


def sse_events(response) -> list:
    text = response.get_data(as_text=True)
    datas = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


def test_completion_shape_usage_and_request_id(client, app):
    r = client.post(
        "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0},
        headers={"X-Request-ID": "req-42"},
    )
    assert r.status_code == 200 and r.headers["X-Request-ID"] == "req-42"
    body = r.get_json()
    assert body["id"] == "cmpl-req-42" and body["object"] == "text_completion"
    assert body["model"] == "lmops-tiny"
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length")
    tok = app.extensions["lmops"].engine.tokenizer
    prompt_tokens = len(tok.encode(PROMPT, add_special_tokens=False).ids)
    usage = body["usage"]
    assert usage["prompt_tokens"] == prompt_tokens and 1 <= usage["completion_tokens"] <= 5
    assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]


def test_prompt_forms_and_n_index_choices(client, app):
    ids = app.extensions["lmops"].engine.tokenizer.encode(PROMPT, add_special_tokens=False).ids
    r = completion(client, prompt=["a", "b c"], n=2)
    assert sorted(c["index"] for c in r.get_json()["choices"]) == [0, 1, 2, 3]
    greedy = completion(client, temperature=0).get_json()["choices"][0]["text"]
    assert completion(client, prompt=ids, temperature=0).get_json()["choices"][0]["text"] == greedy
    r = completion(client, prompt=[ids, ids[:3]])
    assert r.status_code == 200 and r.get_json()["usage"]["prompt_tokens"] == len(ids) + 3


def test_echo_and_logprobs(client, app):
    """echo + logprobs: the prompt's tokens first (the first one's null, as in OpenAI's
    legacy API), then the generated ones; lm-eval's loglikelihood reads exactly this."""
    tok = app.extensions["lmops"].engine.tokenizer
    n_prompt = len(tok.encode(PROMPT, add_special_tokens=False).ids)
    r = completion(client, echo=True, logprobs=2, temperature=0, ignore_eos=True)
    [choice] = r.get_json()["choices"]
    assert choice["text"].startswith(PROMPT)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n_prompt + 4
    assert "".join(lp["tokens"][:n_prompt]) == PROMPT and lp["text_offset"][:2] == [0, len(lp["tokens"][0])]
    assert lp["text_offset"][n_prompt] == len(PROMPT)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"][1:])


def test_prompt_logprobs_equal_a_full_forward(client, app, model_dir):
    """max_tokens 0 with echo scores the prompt only; vLLM's prompt_logprobs gives the same
    numbers by token id with ranks; both equal a plain forward of the model."""
    import torch

    from lmops.runtime.model import Llama

    tok = app.extensions["lmops"].engine.tokenizer
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    with torch.no_grad():
        logits = Llama.from_pretrained(model_dir, "cpu", torch.float32)(torch.tensor([ids]))[0][0, :-1]
    want = torch.log_softmax(logits.float(), -1)[torch.arange(len(ids) - 1), ids[1:]].tolist()
    completion(client, prompt=PROMPT + " again", max_tokens=1)  # the prefix is now cached
    body = completion(client, echo=True, logprobs=0, max_tokens=0, prompt_logprobs=1).get_json()
    [choice] = body["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for entry, token, lp in zip(plp[1:], ids[1:], want, strict=True):
        assert entry[str(token)]["logprob"] == pytest.approx(lp, abs=1e-4)
        assert entry[str(token)]["decoded_token"] == tok.decode([token])
        assert min(e["rank"] for e in entry.values()) == 1


def test_stream_matches_plain_and_ends_with_done(client):
    plain = completion(client, temperature=0, max_tokens=6).get_json()
    r = completion(client, temperature=0, max_tokens=6, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and r.mimetype == "text/event-stream"
    events = sse_events(r)
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == plain["choices"][0]["text"]
    assert [c["finish_reason"] for c in events[-2]["choices"]] == [plain["choices"][0]["finish_reason"]]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == plain["usage"]


def test_stream_with_n_echo_and_logprobs_adds_up_to_the_plain_answer(client, app):
    n_prompt = len(app.extensions["lmops"].engine.tokenizer.encode(PROMPT, add_special_tokens=False).ids)
    body = {"n": 2, "seed": 7, "max_tokens": 6, "echo": True, "logprobs": 1, "ignore_eos": True}
    plain = {c["index"]: c for c in completion(client, **body).get_json()["choices"]}
    texts, tokens = {0: "", 1: ""}, {0: [], 1: []}
    for event in sse_events(completion(client, stream=True, **body)):
        for c in event["choices"]:
            texts[c["index"]] += c["text"]
            tokens[c["index"]] += c["logprobs"]["tokens"]
    for i in (0, 1):
        assert texts[i] == plain[i]["text"] and texts[i].startswith(PROMPT)
        assert tokens[i] == plain[i]["logprobs"]["tokens"] and len(tokens[i]) == n_prompt + 6


def test_predict_and_models(client):
    r = client.post("/predict", json={"prompt": PROMPT, "max_tokens": 3})
    body = r.get_json()
    assert r.status_code == 200 and isinstance(body["completion"], str)
    assert body["model"] == "lmops-tiny" and body["completion_tokens"] <= 3
    [model] = client.get("/v1/models").get_json()["data"]
    assert (model["id"], model["version"], model["run_id"]) == ("lmops-tiny", "7", "run-tiny")
    assert model["max_model_len"] == CONTEXT


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": 5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"max_tokens": CONTEXT + 1}, "max_tokens"),
        ({"n": 1.5}, "n"),
        ({"top_p": 0}, "top_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": 2**63}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [10**6]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"best_of": 2}, "best_of"),
        ({"max_token": 3}, "max_token"),
    ],
)
def test_invalid_values_are_400_naming_the_field(client, body, param):
    assert_error(completion(client, **body), 400, "invalid_value", param)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": [5, -1]}, "prompt.1: Input should be greater than or equal to 0"),
        ({"prompt": [[5], [10**6]]}, "prompt.1.0: Input should be less than or equal to"),
        ({"stop": ["x"] * 10_000}, "stop: List should have at most 8 items"),
        ({"stop": "x" * 300}, "stop: String should have at most 256 characters"),
        ({"prompt": ["a", 3]}, "prompt.1: Input should be a valid string"),
    ],
)
def test_the_message_names_what_is_wrong_in_a_union(client, body, message):
    """`prompt` and `stop` take several shapes; the message used to be the first shape's
    complaint ("Input should be a valid string" for token id -1 or 10,000 stop strings)."""
    assert assert_error(completion(client, **body), 400, "invalid_value")["message"].startswith(message)


def test_missing_prompt_and_non_object_bodies(client):
    assert_error(client.post("/v1/completions", json={"max_tokens": 3}), 400, param="prompt")
    assert_error(client.post("/v1/completions", json=[1, 2]), 400, "invalid_value")
    assert_error(client.post("/predict", json={"prompt": 3}), 400, param="prompt")


@pytest.mark.parametrize(
    "data",
    [
        b"{not json",
        b'{"prompt": "a", "temperature": NaN}',
        b"[" * 5000 + b"]" * 5000,
        b'{"prompt": "\\ud800"}',
        b"\xff\xfe\x00",
    ],
)
def test_bodies_that_are_not_json_are_400(client, data):
    r = client.post("/v1/completions", data=data, content_type="application/json")
    assert_error(r, 400, "invalid_json")


def test_wrong_media_type_415_route_404_method_405_size_413(client):
    r = client.post("/v1/completions", data=json.dumps({"prompt": "a"}), content_type="text/plain")
    assert_error(r, 415, "unsupported_media_type")
    assert_error(client.post("/v1/completions", data=b"prompt=a"), 415)
    assert_error(client.get("/v1/nothing"), 404, "not_found")
    r = client.get("/v1/completions")
    assert_error(r, 405, "method_not_allowed")
    assert "POST" in r.headers["Allow"]
    assert_error(completion(client, prompt="x" * 70_000), 413, "request_too_large")


def test_unknown_model_is_404(client):
    assert_error(completion(client, model="gpt-4"), 404, "model_not_found", "model")
    assert completion(client, model="lmops-tiny").status_code == 200


def test_prompt_too_long_400_with_numbers_or_left_truncated(client):
    error = assert_error(
        completion(client, prompt="to be or not " * 200), 400, "context_length_exceeded", "prompt"
    )
    assert str(CONTEXT) in error["message"] and str(CONTEXT - 1) in error["message"]
    r = completion(client, prompt="to be or not " * 200, truncate_prompt_tokens=10)
    assert r.status_code == 200 and r.get_json()["usage"]["prompt_tokens"] == 10


def test_metrics_has_engine_and_http_series(client):
    completion(client).close()  # the WSGI server closes every response; that records it
    text = client.get("/metrics").get_data(as_text=True)
    for name in (
        "lmops:num_requests_running",
        "lmops:kv_cache_usage_perc",
        "lmops:time_to_first_token_seconds_bucket",
        "http_requests_total",
        "http_request_duration_seconds_bucket",
        "lmops:engine_steps_total",
        "lmops:prompt_bits_per_byte_bucket",
    ):
        assert name in text
    assert "lmops:service_ready 1.0" in text
    # The fixture model has no reference bits/byte in lmops.json: the gauge is absent.
    assert "lmops:model_reference_bits_per_byte" not in text
    assert 'handler="/v1/completions",method="POST",status="200"' in text


def test_openapi_document_carries_the_model_limits(client):
    doc = client.get("/openapi.json").get_json()
    assert doc["openapi"].startswith("3.1") and "/v1/completions" in doc["paths"]
    schema = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert schema["max_tokens"]["anyOf"][0]["maximum"] == CONTEXT
    assert "security" not in doc["paths"]["/v1/completions"]["post"]


def test_not_loaded_yet_is_503_but_probes_and_docs_answer(model_dir):
    client = create_app(ServiceConfig(model_dir=model_dir), start=False).test_client()
    assert_error(completion(client), 503, "not_ready")
    assert_error(client.get("/v1/models"), 503, "not_ready")
    assert_error(client.get("/ready"), 503, "not_ready")
    assert client.get("/health").get_json() == {"status": "loading"}
    assert client.get("/openapi.json").status_code == 200
    assert "lmops:service_ready 0.0" in client.get("/metrics").get_data(as_text=True)


def test_reference_gauge_from_lmops_json_and_warning_without(model_dir, tmp_path, caplog):
    import shutil

    with_ref = shutil.copytree(model_dir, tmp_path / "with-ref")
    meta = json.loads((with_ref / "lmops.json").read_text())
    (with_ref / "lmops.json").write_text(json.dumps({**meta, "metrics": {"test_bits_per_byte": 2.25}}))
    app = load_app(model_dir=with_ref, device="cpu")
    text = app.test_client().get("/metrics").get_data(as_text=True)
    app.extensions["lmops"].shutdown(5)
    assert "lmops:model_reference_bits_per_byte 2.25" in text
    assert "no reference bits/byte" not in caplog.text
    app = load_app(model_dir=model_dir, device="cpu")
    app.extensions["lmops"].shutdown(5)
    assert caplog.text.count("no reference bits/byte") == 1


def test_api_key_is_required_and_compared_in_constant_time(model_dir, monkeypatch):
    client = create_app(ServiceConfig(model_dir=model_dir, api_key="s3cret"), start=False).test_client()
    calls = []
    real = settings_module.hmac.compare_digest
    monkeypatch.setattr(settings_module.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    r = completion(client)
    assert_error(r, 401, "invalid_api_key")
    assert r.headers["WWW-Authenticate"] == "Bearer"
    assert_error(
        client.post("/v1/completions", json={"prompt": "a"}, headers={"Authorization": "Bearer wrong"}), 401
    )
    assert_error(client.get("/v1/models", headers={"Authorization": "Basic s3cret"}), 401)
    # the right key passes authentication (and meets the not-loaded 503)
    assert_error(
        client.post("/v1/completions", json={"prompt": "a"}, headers={"Authorization": "Bearer s3cret"}), 503
    )
    assert len(calls) == 2  # every bearer token went through compare_digest
    assert client.get("/health").status_code == 200
    assert_error(client.get("/ready"), 503, "not_ready")  # open: answered, not refused
    for path in ("/metrics", "/openapi.json", "/no/such/path"):  # everything else needs the key
        assert_error(client.get(path), 401, "invalid_api_key")
    doc = client.get("/openapi.json", headers={"Authorization": "Bearer s3cret"}).get_json()
    for path, method in [("/v1/completions", "post"), ("/metrics", "get"), ("/openapi.json", "get")]:
        assert doc["paths"][path][method]["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/health"]["get"]
    # the probe port's app: probes and metrics without a key, for kubelet and Prometheus
    probe = app_module.probe_app(client.application).test_client()
    assert probe.get("/metrics").status_code == 200 and probe.get("/health").status_code == 200


@pytest.mark.parametrize("key", ["", "   ", "s3cret key", "clé-secrète"])
def test_an_empty_blank_or_unsendable_api_key_refuses_to_start(key, monkeypatch):
    """An empty Secret used to mean "no key" (pydantic-settings' env_ignore_empty), and a
    key no client can send locked everyone out; both stop the server with one line."""
    monkeypatch.setenv("LMOPS_API_KEY", key)
    with pytest.raises(LmopsError, match="^LMOPS_API_KEY: (empty or blank|must be printable ASCII)") as err:
        ServiceConfig.from_env()
    assert "\n" not in str(err.value) and (not key.strip() or key not in str(err.value))
    monkeypatch.delenv("LMOPS_API_KEY")
    assert ServiceConfig.from_env().api_key is None


def test_corrupt_model_fails_with_one_clear_error(model_dir, tmp_path):
    for f in model_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    app = create_app(ServiceConfig(model_dir=tmp_path, device="cpu"))
    runtime = app.extensions["lmops"]
    deadline = time.monotonic() + 30
    while runtime.state == "loading" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runtime.state == "failed" and "model.safetensors" in runtime.error
    client = app.test_client()
    assert_error(client.get("/ready"), 503)
    assert "model.safetensors" in assert_error(client.get("/health"), 503)["message"]


def test_full_queue_is_429_then_shutdown_is_503(model_dir):
    app = load_app(model_dir=model_dir, device="cpu", max_num_seqs=1, max_queued=1)
    runtime, client = app.extensions["lmops"], app.test_client()
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    running = runtime.loop.submit("a", long)
    deadline = time.monotonic() + 10
    while runtime.loop.num_running < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    waiting = runtime.loop.submit("b", long)
    started = time.monotonic()
    r = completion(client)
    assert_error(r, 429, "queue_full")
    assert int(r.headers["Retry-After"]) >= 1 and time.monotonic() - started < 1
    # refused before the body is read: a fast-retrying client costs next to nothing
    assert_error(client.post("/v1/completions", data="{not json", content_type="application/json"), 429)
    running.cancel()
    waiting.cancel()
    runtime.shutdown(1)
    assert_error(completion(client), 503, "shutting_down")
    assert_error(client.get("/ready"), 503)


def test_engine_failure_mid_stream_is_reported_in_band_and_by_health(model_dir):
    app = load_app(model_dir=model_dir, device="cpu")
    runtime, client = app.extensions["lmops"], app.test_client()
    r = client.post(
        "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True},
        buffered=False,
    )
    events = iter(r.response)
    assert next(events).startswith(b"data: {")

    def broken_step():
        raise RuntimeError("simulated device failure")

    runtime.engine.step = broken_step
    rest = b"".join(events).decode()
    error = json.loads(rest.strip().split("\n\n")[-1][len("data: ") :])["error"]
    assert error["code"] == "engine_failed" and "simulated device failure" in error["message"]
    assert "[DONE]" not in rest
    r.close()
    assert_error(client.get("/health"), 503, "unhealthy")
    assert_error(completion(client), 503, "engine_unavailable")


def test_config_from_env_names_the_bad_variable(monkeypatch):
    monkeypatch.setenv("PORT", "8080")
    monkeypatch.setenv("LMOPS_MODEL_URI", "models:/lmops@champion")
    monkeypatch.setenv("LMOPS_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("LMOPS_THREADS", "")  # empty is unset
    config = ServiceConfig.from_env()
    assert (config.port, config.model_uri, config.engine.enable_prefix_caching) == (
        8080,
        "models:/lmops@champion",
        False,
    )
    assert config.worker_threads == config.engine.max_num_seqs + config.max_queued + 8
    monkeypatch.setenv("LMOPS_MAX_NUM_SEQS", "lots")
    with pytest.raises(LmopsError, match="^LMOPS_MAX_NUM_SEQS: .*integer"):
        ServiceConfig.from_env()
    monkeypatch.setenv("LMOPS_MAX_NUM_SEQS", "0")
    with pytest.raises(LmopsError, match="^LMOPS_MAX_NUM_SEQS: max_num_seqs must be"):
        ServiceConfig.from_env()
    monkeypatch.delenv("LMOPS_MAX_NUM_SEQS")
    monkeypatch.setenv("LMOPS_DRIFT_SAMPLE", "2")
    with pytest.raises(LmopsError, match="^LMOPS_DRIFT_SAMPLE: drift_sample must be in"):
        ServiceConfig.from_env()
    monkeypatch.setenv("LMOPS_DRIFT_SAMPLE", "0.5")
    assert ServiceConfig.from_env().engine.drift_sample == 0.5
    monkeypatch.setenv("PORT", "-1")
    with pytest.raises(LmopsError, match="^PORT: "):
        ServiceConfig.from_env()


def test_every_engine_config_field_is_an_lmops_setting(monkeypatch):
    """The mapping is generic: a field added to EngineConfig is LMOPS_<FIELD> here."""
    monkeypatch.setattr(settings_module, "_ENGINE_FIELDS", (*settings_module._ENGINE_FIELDS, "made_up_field"))
    monkeypatch.setenv("LMOPS_MADE_UP_FIELD", "7")
    with pytest.raises(LmopsError, match="LMOPS_MADE_UP_FIELD"):  # EngineConfig has no such field
        ServiceConfig.from_env()
    # fields whose default is None
    unset_examples = {
        "kv_cache_memory": "1000000",
        "quantization": "int8",
        "kv_events_config": '{"hwm": 7}',
        "speculative_model": "/models/draft",
    }
    for f in dataclasses.fields(EngineConfig):
        value = getattr(EngineConfig(), f.name)
        env = str(value).lower() if value is not None else unset_examples[f.name]
        monkeypatch.setenv(f"LMOPS_{f.name.upper()}", env)
    monkeypatch.setenv("LMOPS_NUM_SPECULATIVE_TOKENS", "4")  # a draft model drafts at least 1
    monkeypatch.delenv("LMOPS_MADE_UP_FIELD")
    monkeypatch.setattr(settings_module, "_ENGINE_FIELDS", settings_module._ENGINE_FIELDS[:-1])
    engine = ServiceConfig.from_env().engine
    assert engine.kv_cache_memory == 1000000 and engine.quantization == "int8"
    assert engine.speculative_model == "/models/draft" and engine.num_speculative_tokens == 4
    assert engine.kv_events_config == KVEventsConfig(hwm=7)  # JSON, parsed: vLLM's keys


def test_vllm_sampling_extensions_are_honoured(client, app):
    """min_tokens (stop tokens masked until then), include_stop_str_in_output,
    skip_special_tokens, and OpenAI's logit_bias."""
    tok = app.extensions["lmops"].engine.tokenizer
    x = tok.encode("e", add_special_tokens=False).ids[0]
    forced = {"temperature": 0, "max_tokens": 8, "logit_bias": {str(x): 100}}
    r = completion(client, **forced, stop_token_ids=[x], min_tokens=3).get_json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 4
    eos = {"temperature": 0, "max_tokens": 2, "ignore_eos": True, "logit_bias": {"2": 100}}
    assert completion(client, **eos).get_json()["choices"][0]["text"] == ""
    assert completion(client, **eos, skip_special_tokens=False).get_json()["choices"][0]["text"] == "</s></s>"
    greedy = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    text = completion(client, **greedy).get_json()["choices"][0]["text"]
    stop = text.strip()[2:4] or text[2:4]
    kept = completion(client, **greedy, stop=[stop], include_stop_str_in_output=True).get_json()["choices"][0]
    assert kept["finish_reason"] == "stop" and kept["text"] == text[: text.index(stop) + len(stop)]


def test_unknown_field_names_the_nearest(client):
    error = assert_error(completion(client, max_token=3), 400, "invalid_value", "max_token")
    assert "did you mean 'max_tokens'" in error["message"]
    error = assert_error(client.post("/v1/chat/completions", json={"mesages": []}), 400, param="mesages")
    assert "did you mean 'messages'" in error["message"]


def test_speculative_decoding_is_a_setting_with_metrics(model_dir, client, monkeypatch):
    """LMOPS_NUM_SPECULATIVE_TOKENS turns it on; greedy text is unchanged and /metrics has
    the draft and accepted counts (acceptance rate = their ratio)."""
    monkeypatch.setenv("LMOPS_NUM_SPECULATIVE_TOKENS", "4")
    app = load_app(model_dir=model_dir, device="cpu")
    try:
        assert app.extensions["lmops"].engine.engine_config.num_speculative_tokens == 4
        body = {"prompt": "to be or not to be, to be or not to be, to be", "max_tokens": 24, "temperature": 0}
        spec = app.test_client()
        text = spec.post("/v1/completions", json=body).get_json()["choices"][0]["text"]
        assert text == client.post("/v1/completions", json=body).get_json()["choices"][0]["text"]
        metrics = spec.get("/metrics").get_data(as_text=True)
        counts = {
            line.split()[0]: float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith("lmops:spec_decode_num_")
        }
        drafted = counts["lmops:spec_decode_num_draft_tokens_total"]
        assert drafted > 0 and 0 <= counts["lmops:spec_decode_num_accepted_tokens_total"] <= drafted
    finally:
        app.extensions["lmops"].shutdown(5)
