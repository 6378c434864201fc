"""Structured outputs through the API: response_format and structured_outputs on both
endpoints, every output valid (a random model, many seeds, temperatures up to 1.5, n = 4),
streamed equal to plain, a cut output's finish_reason, bad specs as 400s naming the field,
the metrics; and the real `openai` SDK's `chat.completions.parse` against gunicorn."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.conftest import make_tiny_model_dir
from tests.service.conftest import start_server
from tests.service.test_app import assert_error, sse_events

MESSAGES = [{"role": "user", "content": "Describe a person."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
REGEX = r"[0-9]{3}-[0-9]{4}"
CASES = {
    "json_schema": (
        {"response_format": JSON_SCHEMA},
        lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
    ),
    "regex": ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t) is not None),
    "choice": (
        {"structured_outputs": {"choice": ["red", "green", "blue"]}},
        lambda t: t in ("red", "green", "blue"),
    ),
    "grammar": (
        {"structured_outputs": {"grammar": 'root ::= "x" [a-c]{1,4} "y"'}},
        lambda t: re.fullmatch(r"x[a-c]{1,4}y", t) is not None,
    ),
}


def post(client, endpoint: str, **body):
    base = {"messages": MESSAGES} if endpoint == "chat" else {"prompt": "Name:"}
    return client.post(f"/v1/{'chat/' if endpoint == 'chat' else ''}completions", json={**base, **body})


def texts(endpoint: str, body: dict) -> dict[int, str]:
    key = (lambda c: c["message"]["content"]) if endpoint == "chat" else (lambda c: c["text"])
    return {c["index"]: key(c) for c in body["choices"]}


def streamed(endpoint: str, events: list) -> dict[int, str]:
    out: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            piece = c["delta"].get("content") if endpoint == "chat" else c["text"]
            out[c["index"]] = out.get(c["index"], "") + (piece or "")
    return out


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_output_is_valid_and_streams_byte_identical(client, endpoint, case):
    fields, ok = CASES[case]
    for seed, temperature in ((0, 0.7), (1, 1.0), (2, 1.5)):
        body = {**fields, "n": 4, "seed": seed, "temperature": temperature, "max_tokens": 64}
        r = post(client, endpoint, **body)
        assert r.status_code == 200, r.get_data(as_text=True)
        plain = texts(endpoint, r.get_json())
        assert len(plain) == 4 and all(ok(t) for t in plain.values()), plain
        assert {c["finish_reason"] for c in r.get_json()["choices"]} == {"stop"}
        assert streamed(endpoint, sse_events(post(client, endpoint, stream=True, **body))) == plain


def test_a_cut_output_finishes_with_length(client):
    r = post(client, "chat", response_format=JSON_SCHEMA, max_tokens=3, seed=1)
    [choice] = r.get_json()["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith("{")
    r = post(client, "completions", response_format={"type": "json_object"}, max_tokens=1)
    assert r.get_json()["choices"][0] | {"logprobs": None} == {
        "index": 0,
        "text": "{",
        "logprobs": None,
        "finish_reason": "length",
        "prompt_logprobs": None,
    }
    r = post(client, "chat", response_format={"type": "text"}, max_tokens=2, temperature=0)
    assert r.status_code == 200  # text: no constraint


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"guided_json": SCHEMA},
            "guided_json",
            "guided_json: no longer supported; use structured_outputs.json",
        ),
        ({"guided_regex": "a"}, "guided_regex", "use structured_outputs.regex"),
        ({"guided_choice": ["a"]}, "guided_choice", "use structured_outputs.choice"),
        ({"guided_grammar": "start: a"}, "guided_grammar", "use structured_outputs.grammar"),
        (
            {"response_format": {**JSON_SCHEMA, "json_schema": {"name": "p", "schema": {"type": "strng"}}}},
            "response_format",
            "response_format.json_schema.schema: not a valid JSON schema at type: 'strng'",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"uniqueItems": True}},
                }
            },
            "response_format",
            'Unimplemented keys: ["uniqueItems"]',
        ),
        ({"response_format": {"type": "yaml"}}, "response_format", "does not match any of the expected tags"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "structured_outputs.regex: "),
        ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs", 'unknown name: "nope"'),
        (
            {"structured_outputs": {"choice": []}},
            "structured_outputs",
            "structured_outputs.choice: List should",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
        (
            {"structured_outputs": {"regexp": "a"}},
            "structured_outputs",
            "structured_outputs.regexp: Extra inputs",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "response_format",
            "give one of response_format, structured_outputs or tools",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "min_tokens": 2},
            "min_tokens",
            "min_tokens cannot be combined",
        ),
    ],
)
def test_bad_specs_are_400s_naming_the_field(client, body, param, message):
    error = assert_error(post(client, "chat", **body), 400, param=param)
    assert message in error["message"], error["message"]
    assert "Traceback" not in error["message"]


def test_a_schema_too_slow_to_compile_is_a_400(model_dir):
    from tests.service.conftest import load_app

    app = load_app(model_dir=model_dir, device="cpu", grammar_compile_timeout=0.01)
    schema: dict = {"type": "string", "maxLength": 5}
    for _ in range(8):  # about half a second to compile
        schema = {"type": "object", "properties": {f"p{j}": schema for j in range(3)}, "required": ["p0"]}
    try:
        client = app.test_client()
        post(client, "chat", structured_outputs={"regex": "warm"})  # builds the grammar tokenizer
        body = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
        error = assert_error(post(client, "chat", response_format=body), 400, "grammar_compile_timeout")
        assert error["message"].startswith("response_format.json_schema.schema: the json grammar took longer")
    finally:
        app.extensions["lmops"].shutdown(5)


def test_metrics_count_constrained_requests_and_mask_time(client):
    post(client, "completions", structured_outputs={"choice": ["a", "b"]}, max_tokens=4)
    text = client.get("/metrics").get_data(as_text=True)
    assert re.search(r'^lmops:structured_output_requests_total\{kind="choice"\} [1-9]', text, re.M)
    tokens = float(re.search(r"^lmops:structured_output_tokens_total (\S+)$", text, re.M)[1])
    seconds = float(re.search(r"^lmops:structured_output_mask_seconds_total (\S+)$", text, re.M)[1])
    assert tokens >= 1 and 0 < seconds / tokens < 0.01


class Person(pydantic.BaseModel):
    name: Annotated[str, pydantic.Field(max_length=6)]
    age: Annotated[int, pydantic.Field(ge=0, le=120)]
    mood: Literal["calm", "busy"]


@pytest.mark.slow
def test_openai_sdk_parse_and_extra_body_against_gunicorn(server):
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="test-key", max_retries=0, timeout=30)
    for seed, temperature in ((0, 0.5), (1, 1.0), (2, 1.5)):
        done = oai.chat.completions.parse(
            model="lmops-tiny",
            messages=MESSAGES,
            response_format=Person,
            seed=seed,
            temperature=temperature,
            max_tokens=64,
            n=4,
        )
        assert len(done.choices) == 4
        assert all(isinstance(c.message.parsed, Person) for c in done.choices)
    body = {"structured_outputs": {"regex": REGEX}}
    plain = oai.completions.create(model="lmops-tiny", prompt="Call", max_tokens=16, seed=4, extra_body=body)
    assert re.fullmatch(REGEX, plain.choices[0].text)
    chunks = oai.completions.create(
        model="lmops-tiny", prompt="Call", max_tokens=16, seed=4, stream=True, extra_body=body
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    with pytest.raises(openai.BadRequestError, match="guided_regex: no longer supported"):
        oai.completions.create(model="lmops-tiny", prompt="x", extra_body={"guided_regex": "a"})


@pytest.mark.slow
def test_openai_sdk_tool_calls_round_trip_against_gunicorn(tmp_path):
    """The README's tool-call example, streamed and not, then the tool's answer sent back,
    on a replica whose model has room for the tools' description (1024 tokens of context)."""
    # seeded: whether a sampled call ends within max_tokens depends on the weights, which
    # would otherwise change with whatever drew random numbers before this test
    model_dir = make_tiny_model_dir(tmp_path / "lmops-tiny", max_seq_len=1024, seed=0)
    server = start_server(model_dir, tmp_path / "server.log")
    try:
        tool_round_trip(openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=30))
    finally:
        server.stop()


def tool_round_trip(oai: openai.OpenAI) -> None:
    # The call fits in max_tokens whatever is sampled: one short string and no other key (with
    # extra keys allowed, a random model can add them until max_tokens, as one layout's did).
    city = {"type": "string", "maxLength": 8}
    weather = {
        "type": "object",
        "properties": {"city": city},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "weather", "parameters": weather}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    ask = {"model": "lmops-tiny", "tools": tools, "max_tokens": 200, "seed": 3, "parallel_tool_calls": False}
    done = oai.chat.completions.create(**ask, messages=messages, tool_choice="required")
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "weather"
    jsonschema.validate(json.loads(call.function.arguments), weather)

    stream = oai.chat.completions.create(**ask, messages=messages, tool_choice="required", stream=True)
    streamed = [c for c in stream if c.choices]
    deltas = [d for c in streamed for d in c.choices[0].delta.tool_calls or []]
    assert [d.function.arguments for d in deltas] == [call.function.arguments]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"

    answer = oai.chat.completions.create(
        **{**ask, "max_tokens": 8},
        messages=[*messages, choice.message, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}],
        tool_choice="none",
    )
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content
