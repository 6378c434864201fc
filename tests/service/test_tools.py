"""Tool calls on /v1/chat/completions: required and named calls constrained to the
function's parameters, auto admitting text or a call, none free; OpenAI's tool_calls shape
plain and streamed (equal for a seed), finish_reason "tool_calls", a round trip through a
`tool` message, and bad tools or tool_choice as 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.conftest import make_tiny_model_dir
from tests.service.conftest import load_app
from tests.service.test_app import assert_error, sse_events

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "maximum": 99}},
    "required": ["a"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
SCHEMAS = {"weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """A model with room for the tools' description in its context (the plain template's
    system message)."""
    app = load_app(
        model_dir=make_tiny_model_dir(tmp_path_factory.mktemp("tools"), max_seq_len=1024), device="cpu"
    )
    yield app.test_client()
    app.extensions["lmops"].shutdown(5)


def chat(client, **body):
    body = {"messages": MESSAGES, "tools": TOOLS, "parallel_tool_calls": False, "max_tokens": 160, **body}
    return client.post("/v1/chat/completions", json=body)


def calls_of(choice: dict) -> list[dict]:
    return choice["message"]["tool_calls"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_required_and_named_calls_follow_the_parameters(client, tool_choice):
    for seed, temperature in ((0, 0.8), (1, 1.5)):
        body = {"tool_choice": tool_choice, "seed": seed, "temperature": temperature, "n": 3}
        r = chat(client, **body)
        assert r.status_code == 200, r.get_data(as_text=True)
        plain = r.get_json()["choices"]
        for choice in plain:
            assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
            [call] = calls_of(choice)
            assert call["type"] == "function" and call["id"].startswith("call_")
            name = call["function"]["name"]
            assert name == "add" or (tool_choice == "required" and name == "weather")
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
        streamed = {}
        for event in sse_events(chat(client, stream=True, **body)):
            for c in event["choices"]:
                assert not c["delta"].get("content")  # held back: it was a call all along
                if c["delta"].get("tool_calls"):
                    streamed[c["index"]] = (c["delta"]["tool_calls"], c["finish_reason"])
        for choice in plain:
            [delta], reason = streamed[choice["index"]]
            assert reason == "tool_calls" and delta["index"] == 0
            assert delta["function"] == calls_of(choice)[0]["function"]


def test_auto_admits_text_or_a_call_and_none_is_free(client):
    outs = [
        chat(client, tool_choice="auto", seed=s, max_tokens=24).get_json()["choices"][0] for s in range(4)
    ]
    for choice in outs:
        if choice["finish_reason"] == "tool_calls":
            [call] = calls_of(choice)
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
        else:
            assert not choice["message"]["content"].startswith("<")  # text, never a broken call
    free = chat(client, tool_choice="none", seed=0, max_tokens=8, temperature=0).get_json()["choices"][0]
    assert free["message"]["tool_calls"] is None and free["finish_reason"] in ("stop", "length")
    body = {"tool_choice": "auto", "seed": 2, "n": 2, "max_tokens": 24}
    plain = {c["index"]: c["message"]["content"] or "" for c in chat(client, **body).get_json()["choices"]}
    text = {}
    for event in sse_events(chat(client, stream=True, **body)):
        for c in event["choices"]:
            text[c["index"]] = text.get(c["index"], "") + (c["delta"].get("content") or "")
    assert {i: t for i, t in text.items() if plain[i]} == {i: t for i, t in plain.items() if t}


def test_a_tool_round_trip(client):
    first = chat(client, tool_choice="required", seed=1).get_json()["choices"][0]
    [call] = calls_of(first)
    later = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"},
    ]
    r = chat(client, messages=later, tool_choice="none", max_tokens=8)
    assert r.status_code == 200 and r.get_json()["choices"][0]["message"]["content"] is not None
    prompt = client.post("/tokenize", json={"messages": later}).get_json()
    assert prompt["count"] > 0


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope' is not in tools",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strng"}}}]},
            "tools",
            "tools[0].function.parameters: not a JSON schema",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"uniqueItems": True}}}]},
            "tools",
            "Unimplemented keys",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools",
            "tools.0.function.name",
        ),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "tool_choice: needs tools"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "give one of",
        ),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages", "content is required"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(client, body, param, message):
    error = assert_error(
        chat(client, tool_choice="required", **body) if "tool_choice" not in body else chat(client, **body),
        400,
        param=param,
    )
    assert message in error["message"], error["message"]
