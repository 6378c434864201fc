"""The API's bodies as pydantic models, and /openapi.json generated from them.

Requests are validated by these models and responses are built from them, so the
document cannot drift from the behaviour. The request limits that depend on the
loaded model (context, vocabulary) come from `Limits`; `request_models(limits)`
builds (and caches) the request models for them.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from lmops.runtime.engine.config import PRIORITY_BOUND
from lmops.runtime.engine.sampling import RANGES
from production_service.errors import APIError

MAX_PROMPTS = 16
MAX_N = 16
MAX_STOP = 8
MAX_STOP_CHARS = 256
MODEL_DEFAULT = " Default: the model's generation_config.json."
FinishReason = Literal["stop", "length", "abort", "tool_calls"]


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    # The longest token in characters: a text longer than max_token_chars * N
    # characters has more than N tokens, which is known without tokenizing it.
    max_token_chars: int = 1
    # LMOPS_SCHEDULING_POLICY=priority: a request may set its priority (under fcfs only 0).
    priority_scheduling: bool = False

    @property
    def max_prompt_tokens(self) -> int:
        return max(self.max_model_len - 1, 1)

    @property
    def max_prompt_chars(self) -> int:
        return self.max_prompt_tokens * self.max_token_chars


UNLOADED = Limits(max_model_len=2**31 - 1, vocab_size=2**31 - 1, max_num_seqs=MAX_N, priority_scheduling=True)


class _Request(BaseModel):
    # strict: "3" is not a number and 1 is not a boolean, as in the JSON Schema
    model_config = ConfigDict(strict=True, extra="forbid")


def _integral(value):
    """JSON Schema's integers include 2.0; strict pydantic's do not."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _integer(lo: int, hi: int, description: str | None = None):
    # Field before the validator, or the schema says "ge"/"le" instead of minimum/maximum
    return Annotated[int, Field(ge=lo, le=hi, description=description), BeforeValidator(_integral)]


def _int(lo: int, hi: int, description: str | None = None):
    return _integer(lo, hi, description) | None


def _sampling(field: str, description: str | None = None, cap: float | None = None):
    """An optional request field with SamplingParams' range for `field` (lmops.runtime.engine.sampling.RANGES),
    its upper bound lowered to `cap` where the loaded model sets one."""
    r = RANGES[field]
    hi = r.hi if cap is None else cap if r.hi is None else min(r.hi, cap)
    if r.integer:
        lo = int(r.lo) + 1 if r.lo_open else int(r.lo)
        return _integer(lo, hi, description) | None
    low = {"gt": r.lo} if r.lo_open else {"ge": r.lo}
    return Annotated[float, Field(**low, le=hi, allow_inf_nan=False, description=description)] | None


class ResponseFormatText(_Request):
    type: Literal["text"]


class ResponseFormatJsonObject(_Request):
    type: Literal["json_object"]


class JsonSchemaSpec(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: str | None = None
    schema_: dict = Field(alias="schema", description="The JSON schema the output follows.")
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced.")


class ResponseFormatJsonSchema(_Request):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema, Field(discriminator="type")
]


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs`: exactly one of json, json_object, regex, choice, grammar."""

    json_: dict | str | None = Field(None, alias="json", description="A JSON schema (object or its text).")
    json_object: bool | None = Field(None, description="Any JSON object.")
    regex: str | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    grammar: str | None = Field(None, description="A Lark or GBNF grammar.")
    whitespace_pattern: str | None = Field(
        None, description="JSON only: the regex of whitespace allowed between tokens (default: none)."
    )


class StreamOptions(_Request):
    include_usage: bool = Field(False, description="A last event with the usage and no choices.")
    continuous_usage_stats: bool = Field(False, description="The usage so far in every event (vLLM extra).")


@dataclass(frozen=True)
class RequestModels:
    completion: type[_Request]
    predict: type[_Request]
    chat: type[_Request]
    tokenize: type[_Request]
    detokenize: type[_Request]


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = Field(
        description="A string, or text parts (joined with no separator); null for an assistant's tool calls."
    )
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant turn's calls.")
    tool_call_id: str | None = Field(None, description="The call a tool message answers.")

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required, except for an assistant message with tool_calls")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class Function(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: str | None = None
    parameters: dict = Field(
        default_factory=lambda: {"type": "object"}, description="A JSON schema of the arguments."
    )
    strict: bool | None = Field(None, description="Accepted; the parameters are always enforced.")


class Tool(_Request):
    type: Literal["function"]
    function: Function


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


@functools.lru_cache(maxsize=4)
def request_models(limits: Limits) -> RequestModels:
    """Every endpoint's request model for a model's limits."""
    max_model_len, vocab = limits.max_model_len, limits.vocab_size
    text = Annotated[str, Field(min_length=1)]
    token_id = _integer(0, vocab - 1)
    token_ids = Annotated[list[token_id], Field(min_length=1, max_length=limits.max_prompt_tokens)]
    stop_text = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]

    class Sampling(_Request):
        max_tokens: _sampling(
            "max_tokens",
            "Capped at the room the context leaves after the prompt." + MODEL_DEFAULT,
            max_model_len,
        ) = None
        temperature: _sampling("temperature", "0 = greedy." + MODEL_DEFAULT) = None
        top_p: _sampling("top_p", "Nucleus sampling mass." + MODEL_DEFAULT) = None
        top_k: _sampling("top_k", "0 or -1 = disabled (vLLM extra)." + MODEL_DEFAULT, vocab) = None
        seed: _sampling("seed") = None
        stop: stop_text | Annotated[list[stop_text], Field(max_length=MAX_STOP)] | None = Field(
            None, description="Generation stops before any of these strings; they are not returned."
        )

        def sampling_fields(self) -> dict:
            """The SamplingParams fields this API spells its own way."""
            return {}

    class Generation(Sampling):
        """What completions and chat share."""

        model: str | None = Field(None, description="Must be the served model's id when given.")
        n: _sampling("n", cap=min(MAX_N, limits.max_num_seqs)) = None
        presence_penalty: _sampling("presence_penalty") = None
        frequency_penalty: _sampling("frequency_penalty") = None
        repetition_penalty: _sampling("repetition_penalty", "vLLM extra. Default 1.") = None
        min_p: _sampling("min_p", "vLLM extra. Default 0.") = None
        stop_token_ids: Annotated[list[token_id], Field(max_length=MAX_STOP)] | None = Field(
            None, description="vLLM extra."
        )
        ignore_eos: bool | None = Field(None, description="vLLM extra.")
        stream: bool | None = Field(None, description="Server-sent events ending in `data: [DONE]`.")
        stream_options: StreamOptions | None = None
        user: str | None = Field(None, description="Accepted and ignored.")
        min_tokens: _sampling(
            "min_tokens", "No EOS, stop token or stop string before this many (vLLM extra).", max_model_len
        ) = None
        include_stop_str_in_output: bool | None = Field(
            None, description="Keep the stop string (vLLM extra)."
        )
        skip_special_tokens: bool | None = Field(
            None, description="Leave special tokens out of the text (vLLM extra; default true)."
        )
        logit_bias: (
            Annotated[
                dict[
                    Annotated[str, Field(pattern=r"^[0-9]+$")],
                    Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)],
                ],
                Field(json_schema_extra={"additionalProperties": False}),
            ]
            | None
        ) = Field(None, description="Token id -> bias added to its logit.")
        response_format: ResponseFormat | None = Field(
            None, description="OpenAI's: text, any JSON object, or JSON following a schema (enforced)."
        )
        structured_outputs: StructuredOutputsRequest | None = Field(
            None, description="vLLM's: the output follows a JSON schema, regex, choice or grammar."
        )
        priority: (
            _int(
                -PRIORITY_BOUND,
                PRIORITY_BOUND - 1,
                "vLLM extra: lower runs first, and is preempted last. Default 0.",
            )
            if limits.priority_scheduling
            else _int(
                0, 0, "vLLM extra: only 0 here, which serves in arrival order (LMOPS_SCHEDULING_POLICY=fcfs)."
            )
        ) = None

    class CompletionRequest(Generation):
        prompt: (
            text
            | Annotated[list[text], Field(min_length=1, max_length=MAX_PROMPTS)]
            | token_ids
            | Annotated[list[token_ids], Field(min_length=1, max_length=MAX_PROMPTS)]
        ) = Field(description="A string, strings, token ids, or lists of token ids.")
        logprobs: _sampling(
            "logprobs", "Top log-probabilities per generated token; with echo, per prompt token too."
        ) = None
        prompt_logprobs: _sampling(
            "prompt_logprobs", "Log-probs of the prompt's tokens and this many alternatives (vLLM extra)."
        ) = None
        echo: bool | None = Field(None, description="Prepend the prompt to the text.")
        truncate_prompt_tokens: _int(
            1,
            limits.max_prompt_tokens,
            "Keep only the last k prompt tokens (vLLM extra); without it a prompt longer "
            "than the context is a 400.",
        ) = None

        def sampling_fields(self) -> dict:
            plp = self.prompt_logprobs
            if self.echo and self.logprobs is not None:  # the echoed prompt's log-probs too
                plp = max(self.logprobs, plp or 0)
            return {"logprobs": self.logprobs, "prompt_logprobs": plp}

    class ChatCompletionRequest(Generation):
        messages: Annotated[list[Message], Field(min_length=1)]
        max_completion_tokens: _sampling(
            "max_tokens", "OpenAI's newer name for max_tokens.", max_model_len
        ) = None
        logprobs: bool | None = Field(None, description="Log-probs of the generated tokens.")
        top_logprobs: _sampling("logprobs", "Alternatives per token, with logprobs.") = None
        add_generation_prompt: bool = Field(True, description="End with the assistant's turn (vLLM extra).")
        tools: Annotated[list[Tool], Field(max_length=128)] | None = None
        tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
            None, description="Default auto with tools; required and a named function are enforced."
        )
        parallel_tool_calls: bool | None = Field(None, description="false: at most one call. Default true.")

        def sampling_fields(self) -> dict:
            return {
                "logprobs": (self.top_logprobs or 0) if self.logprobs else None,
                "max_tokens": self.max_completion_tokens,
            }

    class PredictRequest(Sampling):
        prompt: text

    class TokenizeRequest(_Request):
        """vLLM's: a prompt, or chat messages rendered by the chat template."""

        model: str | None = None
        prompt: str | None = None
        messages: Annotated[list[Message], Field(min_length=1)] | None = None
        add_special_tokens: bool | None = Field(
            None, description="Default: true for a prompt, false for messages."
        )
        add_generation_prompt: bool = True
        return_token_strs: bool = False

        @model_validator(mode="after")
        def _one_input(self):
            if (self.prompt is None) == (self.messages is None):
                raise ValueError("give exactly one of prompt or messages")
            return self

    class DetokenizeRequest(_Request):
        model: str | None = None
        tokens: Annotated[list[token_id], Field(max_length=max_model_len)]

    return RequestModels(
        CompletionRequest, PredictRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest
    )


def check_fields(model: type[_Request], body: object) -> None:
    """An unknown top-level field is a 400 naming it and the nearest known one."""
    if not isinstance(body, dict):
        return
    for name in body:
        if name not in model.model_fields:
            near = difflib.get_close_matches(str(name), list(model.model_fields), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise APIError(400, f"{name}: unknown field{hint}", code="invalid_value", param=str(name))


def validate(model: type[_Request], body: object) -> _Request:
    """The body as `model`; the first error becomes a 400 naming the field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = _most_telling(exc.errors(include_url=False, include_input=False))
        # a union's errors carry the member's type in the location ('prompt', 'list[...]', 0)
        loc = [str(p) for p in error["loc"] if isinstance(p, int) or p.isidentifier()]
        param = loc[0] if loc else None
        raise APIError(
            400, f"{'.'.join(loc) or 'body'}: {error['msg'][:200]}", code="invalid_value", param=param
        ) from None


def _most_telling(errors: list[dict]) -> dict:
    """Of the first wrong field's errors (one per member of a union such as `prompt`'s),
    the one that got furthest: a wrong value of the right type (token id -1, 10,000 stop
    strings) rather than "Input should be a valid string" from a member it never was."""
    field = errors[0]["loc"][:1]
    candidates = [e for e in errors if e["loc"][:1] == field]
    return max(candidates, key=lambda e: (not e["type"].endswith("_type"), len(e["loc"])))


# -- responses -----------------------------------------------------------------------


class Logprobs(BaseModel):
    """OpenAI's legacy shape; with echo the prompt's tokens come first, the first one's null."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str


class Choice(BaseModel):
    index: int
    text: str
    logprobs: Logprobs | None
    finish_reason: FinishReason | None = Field(description="null until a streamed choice's last chunk")
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None, description="With prompt_logprobs (vLLM's shape): per prompt token, by token id."
    )


class Usage(BaseModel):
    prompt_tokens: Annotated[int, Field(ge=0)]
    completion_tokens: Annotated[int, Field(ge=0)]
    total_tokens: Annotated[int, Field(ge=0)]


class _Answer(BaseModel):
    """What a completion body and a streamed chunk of either API carry, in OpenAI's order;
    each narrows `object` and `choices` (and a whole answer's `usage`)."""

    id: str
    object: str
    created: int
    model: str
    choices: list
    usage: Usage | None = None


class CompletionChunk(_Answer):
    """One streamed event's data (`usage` only in the last, with stream_options.include_usage)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[Choice]


class Completion(CompletionChunk):
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ToolCallDelta(ToolCall):
    index: int


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None = Field(description="null until a choice's last chunk")


class ChatCompletionChunk(_Answer):
    """One streamed event's data: the first per choice carries the role, the last its
    finish_reason; `usage` as in CompletionChunk."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ChatCompletion(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class Tokens(BaseModel):
    """vLLM's /tokenize answer."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class Rendered(BaseModel):
    """vLLM's render answer (the part llm-d's token producer reads): one prompt's token ids."""

    token_ids: list[int]


class Detokenized(BaseModel):
    prompt: str


class Prediction(BaseModel):
    completion: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "lmops"
    max_model_len: int
    version: str | None
    run_id: str | None
    source: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Status(BaseModel):
    status: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class Error(BaseModel):
    error: ErrorDetail


# -- the document ------------------------------------------------------------------


_ERRORS = {
    400: "Invalid value (`param` names the field) or body not JSON",
    401: "Missing or wrong bearer token",
    404: "Unknown model",
    413: "Body over the size limit",
    415: "Body is not application/json",
    429: "Queue full; retry after `Retry-After` seconds",
    503: "Model not loaded yet, or shutting down",
}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


def _errors(*statuses: int) -> dict:
    out = {str(s): _json("Error", _ERRORS[s]) for s in statuses}
    if "429" in out:
        out["429"]["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "required": True}}
    return out


def _schemas(*models: type[BaseModel]) -> dict:
    """Each model's JSON Schema under its name, nested models hoisted beside it."""
    out: dict = {}
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out


@functools.lru_cache(maxsize=4)
def build_document(limits: Limits, api_key: bool) -> dict:
    secured = {"security": [{"bearer": []}]} if api_key else {}
    auth = (401,) if api_key else ()

    def post(summary: str, body: str, ok: dict, *errors: int) -> dict:
        return {
            "post": {
                "summary": summary,
                **secured,
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(body)}}},
                "responses": {"200": ok, **_errors(400, *auth, *errors, 413, 415, 429, 503)},
            }
        }

    def get(summary: str, ok: dict, responses: dict | None = None, **extra) -> dict:
        return {"get": {"summary": summary, **extra, "responses": {"200": ok, **(responses or {})}}}

    def streamed(chunk: str) -> dict:
        return {
            "type": "object",
            "required": ["data"],
            "properties": {
                "data": {
                    "anyOf": [
                        {"const": "[DONE]"},
                        {"contentMediaType": "application/json", "contentSchema": _ref(chunk)},
                    ]
                }
            },
            "description": "One server-sent event: a chunk, then `[DONE]`.",
        }

    def answer(body: str, event: str) -> dict:
        return {
            "description": "The answer, or with `stream: true` server-sent events",
            "content": {
                "application/json": {"schema": _ref(body)},
                "text/event-stream": {"schema": _ref(event)},
            },
        }

    text = {
        "description": "Prometheus text format",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
    document = {"description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}}
    paths = {
        "/v1/completions": post(
            "OpenAI-compatible text completion",
            "CompletionRequest",
            answer("Completion", "StreamEvent"),
            404,
        ),
        "/v1/chat/completions": post(
            "OpenAI-compatible chat completion (the model's chat template renders the messages)",
            "ChatCompletionRequest",
            answer("ChatCompletion", "ChatStreamEvent"),
            404,
        ),
        "/tokenize": post(
            "vLLM's: a prompt or chat messages to token ids",
            "TokenizeRequest",
            _json("Tokens", "Token ids"),
            404,
        ),
        "/detokenize": post(
            "vLLM's: token ids to text", "DetokenizeRequest", _json("Detokenized", "The text"), 404
        ),
        "/v1/completions/render": post(
            "vLLM's: each prompt's token ids (for llm-d's token producer; keyless on the probe port)",
            "CompletionRequest",
            {
                "description": "One entry per prompt",
                "content": {"application/json": {"schema": {"type": "array", "items": _ref("Rendered")}}},
            },
            404,
        ),
        "/v1/chat/completions/render": post(
            "vLLM's: the chat prompt's token ids (for llm-d's token producer; keyless on the probe port)",
            "ChatCompletionRequest",
            _json("Rendered", "Token ids"),
            404,
        ),
        "/predict": post(
            "The simple form: a prompt in, a completion out",
            "PredictRequest",
            _json("Prediction", "The completion"),
        ),
        "/v1/models": get(
            "The served model, with registry version and run id",
            _json("ModelList", "Models"),
            _errors(*auth, 503),
            **secured,
        ),
        "/health": get(
            "Liveness: process up, engine loop not stuck",
            _json("Status", "Alive"),
            {"503": _json("Error", "Engine loop stuck or failed")},
        ),
        "/ready": get(
            "Readiness: model loaded and warmed up, not draining", _json("Status", "Ready"), _errors(503)
        ),
        "/metrics": get("Prometheus metrics: engine and HTTP", text, _errors(*auth), **secured),
        "/openapi.json": get("This document", document, _errors(*auth), **secured),
    }
    models = request_models(limits)
    schemas = _schemas(
        *(getattr(models, f.name) for f in dataclasses.fields(models)),
        Completion,
        CompletionChunk,
        ChatCompletion,
        ChatCompletionChunk,
        Tokens,
        Rendered,
        Detokenized,
        Prediction,
        ModelList,
        Status,
        Error,
    )
    events = {"StreamEvent": streamed("CompletionChunk"), "ChatStreamEvent": streamed("ChatCompletionChunk")}
    components: dict = {"schemas": {**schemas, **events}}
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "lmops inference service", "version": "1.0.0"},
        "paths": paths,
        "components": components,
    }
