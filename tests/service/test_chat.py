"""/v1/chat/completions, /tokenize and /detokenize in-process: OpenAI's chat shapes
(plain, streamed, n, stop, logprobs, usage), the chat template (the model's, an override,
none), and errors in OpenAI's shape."""

from __future__ import annotations

import json
import shutil

import pytest

from lmops.runtime.json_files import read_json_object
from lmops.runtime.model_dir import TOKENIZER_CONFIG_FILE
from tests.service.conftest import CONTEXT, load_app
from tests.service.test_app import assert_error, sse_events

MESSAGES = [{"role": "system", "content": "Speak verse."}, {"role": "user", "content": "ROMEO: What light"}]
RENDERED = "System: Speak verse.\n\nUser: ROMEO: What light\n\nAssistant:"
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"messages": MESSAGES, **GREEDY, **body})


def test_chat_is_the_completion_of_the_rendered_prompt(client):
    r = chat(client, seed=3)
    assert r.status_code == 200, r.get_data(as_text=True)
    body = r.get_json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    plain = client.post("/v1/completions", json={"prompt": RENDERED, **GREEDY}).get_json()
    assert choice["message"] == {
        "role": "assistant",
        "content": plain["choices"][0]["text"],
        "tool_calls": None,
    }
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert body["usage"] == plain["usage"]


def test_stream_adds_up_to_the_plain_answer_with_usage(client):
    body = {"n": 2, "seed": 5, "temperature": 1.0, "logprobs": True, "top_logprobs": 2}
    plain = {c["index"]: c for c in chat(client, **body).get_json()["choices"]}
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = sse_events(chat(client, stream=True, stream_options=options, **body))
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    text, tokens, roles = {0: "", 1: ""}, {0: [], 1: []}, {0: [], 1: []}
    for e in events[:-1]:
        assert e["usage"]["prompt_tokens"] > 0  # continuous_usage_stats: in every chunk
        for c in e["choices"]:
            text[c["index"]] += c["delta"].get("content") or ""
            roles[c["index"]].append(c["delta"].get("role"))
            tokens[c["index"]] += (c["logprobs"] or {"content": []})["content"]
    for i in (0, 1):
        assert roles[i][0] == "assistant" and set(roles[i][1:]) <= {None}
        assert text[i] == plain[i]["message"]["content"]
        # The same tokens; their logprobs to float rounding (the second request may reuse the
        # first's cached prompt blocks, or score its prompt for the drift sample, either of
        # which computes the same numbers in another order).
        want = plain[i]["logprobs"]["content"]
        assert choices(tokens[i]) == choices(want) and len(tokens[i]) == 6
        assert logprobs(tokens[i]) == pytest.approx(logprobs(want), abs=1e-5)
        assert all(len(t["top_logprobs"]) == 2 and t["bytes"] == list(t["token"].encode()) for t in tokens[i])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12


def test_stop_and_max_completion_tokens(client):
    text = chat(client, max_tokens=12).get_json()["choices"][0]["message"]["content"]
    stop = text.strip()[2:4] or text[2:4]
    stopped = chat(client, max_tokens=12, stop=[stop]).get_json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["message"]["content"] == text[: text.index(stop)]
    short = chat(client, max_tokens=None, max_completion_tokens=2).get_json()
    assert short["usage"]["completion_tokens"] == 2


def test_content_parts_and_generation_prompt(client):
    parts = [{"type": "text", "text": "ROMEO: "}, {"type": "text", "text": "What light"}]
    messages = [MESSAGES[0], {"role": "user", "content": parts}]
    same = client.post("/tokenize", json={"messages": messages}).get_json()
    assert same == client.post("/tokenize", json={"messages": MESSAGES}).get_json()
    bare = client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).get_json()
    assert client.post("/detokenize", json={"tokens": bare["tokens"]}).get_json() == {
        "prompt": RENDERED[: -len("Assistant:")]
    }


def test_tokenize_and_detokenize(client, app):
    tok = app.extensions["lmops"].engine.tokenizer
    r = client.post("/tokenize", json={"prompt": "ROMEO: What light", "return_token_strs": True}).get_json()
    ids = tok.encode("ROMEO: What light").ids
    assert r == {
        "count": len(ids),
        "max_model_len": CONTEXT,
        "tokens": ids,
        "token_strs": [tok.id_to_token(i) for i in ids],
    }
    chat_ids = client.post("/tokenize", json={"messages": MESSAGES}).get_json()["tokens"]
    assert chat_ids == tok.encode(RENDERED, add_special_tokens=False).ids
    assert client.post("/detokenize", json={"tokens": chat_ids}).get_json() == {"prompt": RENDERED}
    assert_error(client.post("/tokenize", json={}), 400, "invalid_value")
    assert_error(client.post("/tokenize", json={"prompt": "a", "messages": MESSAGES}), 400, "invalid_value")
    assert_error(client.post("/detokenize", json={"tokens": [10**6]}), 400, "invalid_value", "tokens")
    assert_error(
        client.post("/tokenize", json={"prompt": "a", "model": "gpt-4"}), 404, "model_not_found", "model"
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"max_completion_tokens": 0.5}, "max_completion_tokens"),
        ({"n": 99}, "n"),
    ],
)
def test_errors_in_openai_shape(client, body, param):
    assert_error(chat(client, **body), 400, "invalid_value", param)


def test_unknown_model_and_too_long(client):
    assert_error(chat(client, model="gpt-4"), 404, "model_not_found", "model")
    long = [{"role": "user", "content": "to be " * 5000}]
    assert_error(chat(client, messages=long), 400, "context_length_exceeded")


def test_template_override_and_none(model_dir, tmp_path):
    """LMOPS_CHAT_TEMPLATE replaces the model's; a model with none is a 400 naming the fix."""
    bare = tmp_path / "no-template"
    shutil.copytree(model_dir, bare)
    config = read_json_object(bare / TOKENIZER_CONFIG_FILE, "tokenizer config")
    del config["chat_template"]
    (bare / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config))
    app = load_app(model_dir=bare, device="cpu")
    try:
        error = assert_error(chat(app.test_client()), 400, "chat_template_missing", "messages")
        assert "LMOPS_CHAT_TEMPLATE" in error["message"] and "chat_template" in error["message"]
        assert (
            app.test_client().post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code
            == 200
        )
    finally:
        app.extensions["lmops"].shutdown(5)
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}>")
    app = load_app(model_dir=bare, device="cpu", chat_template=template)
    try:
        ids = app.test_client().post("/tokenize", json={"messages": MESSAGES[1:]}).get_json()["tokens"]
        text = app.test_client().post("/detokenize", json={"tokens": ids}).get_json()["prompt"]
        assert text == "<user>ROMEO: What light>"
        assert chat(app.test_client(), messages=MESSAGES[1:]).status_code == 200
    finally:
        app.extensions["lmops"].shutdown(5)


def logprobs(tokens: list[dict]) -> list[float]:
    """Each token's logprob and its top alternatives', in order."""
    return [lp for t in tokens for lp in (t["logprob"], *(a["logprob"] for a in t["top_logprobs"]))]


def choices(tokens: list[dict]) -> list[tuple]:
    """Each token and its top alternatives, without the logprobs."""
    return [(t["token"], t["bytes"], [a["token"] for a in t["top_logprobs"]]) for t in tokens]
