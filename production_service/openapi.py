"""The OpenAPI 3.1 document, which is also the request validator: requests are
checked against the very schemas served at /openapi.json, so the document
cannot drift from the behaviour. Limits that depend on the loaded model
(context length, vocabulary) are filled in once it is loaded."""

from __future__ import annotations

import re
from dataclasses import dataclass

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from production_service.errors import APIError

MAX_PROMPTS = 16
MAX_N = 16
MAX_STOP = 8
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int
    max_num_seqs: int


def _nullable(schema: dict, description: str = "") -> dict:
    out = {**schema, "type": [schema["type"], "null"]}
    return {**out, "description": description} if description else out


def _number(lo: float, hi: float, description: str, exclusive_lo: bool = False) -> dict:
    low = {"exclusiveMinimum": lo} if exclusive_lo else {"minimum": lo}
    return _nullable({"type": "number", **low, "maximum": hi}, description)


def request_schemas(limits: Limits | None) -> dict:
    ctx = limits.max_model_len if limits else 2**31 - 1
    vocab = limits.vocab_size if limits else 2**31 - 1
    max_n = min(MAX_N, limits.max_num_seqs) if limits else MAX_N
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab - 1}
    token_ids = {"type": "array", "minItems": 1, "maxItems": max(ctx - 1, 1), "items": token_id}
    text = {"type": "string", "minLength": 1}
    stop = {
        "anyOf": [
            {**text, "maxLength": 256},
            {"type": "array", "maxItems": MAX_STOP, "items": {**text, "maxLength": 256}},
            {"type": "null"},
        ],
        "description": "Generation stops before any of these strings; they are not returned.",
    }
    sampling = {
        "max_tokens": _nullable(
            {"type": "integer", "minimum": 1, "maximum": ctx, "default": 16},
            "Capped at the room the context leaves after the prompt (finish_reason `length`).",
        ),
        "temperature": _number(0, 2, "0 = greedy. Default 1."),
        "top_p": _number(0, 1, "Nucleus sampling mass. Default 1.", exclusive_lo=True),
        "top_k": _nullable(
            {"type": "integer", "minimum": -1, "maximum": vocab}, "0 or -1 = disabled (vLLM extra)."
        ),
        "seed": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_SEED}),
        "stop": stop,
    }
    completion = {
        "type": "object",
        "additionalProperties": False,
        "required": ["prompt"],
        "properties": {
            "model": _nullable({"type": "string"}, "Must be the served model's id when given."),
            "prompt": {
                "anyOf": [
                    text,
                    {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": text},
                    token_ids,
                    {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": token_ids},
                ],
                "description": "A string, strings, token ids, or lists of token ids.",
            },
            **sampling,
            "n": _nullable({"type": "integer", "minimum": 1, "maximum": max_n}),
            "logprobs": _nullable(
                {"type": "integer", "minimum": 0, "maximum": 20}, "Top log-probabilities per generated token."
            ),
            "presence_penalty": _number(-2, 2, ""),
            "frequency_penalty": _number(-2, 2, ""),
            "repetition_penalty": _number(0, 2, "vLLM extra. Default 1.", exclusive_lo=True),
            "min_p": _number(0, 1, "vLLM extra. Default 0."),
            "stop_token_ids": _nullable(
                {"type": "array", "maxItems": MAX_STOP, "items": token_id}, "vLLM extra."
            ),
            "ignore_eos": _nullable({"type": "boolean"}, "vLLM extra."),
            "echo": _nullable({"type": "boolean"}, "Prepend the prompt to the text."),
            "stream": _nullable({"type": "boolean"}, "Server-sent events ending in `data: [DONE]`."),
            "stream_options": _nullable(
                {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"include_usage": {"type": "boolean"}},
                }
            ),
            "truncate_prompt_tokens": _nullable(
                {"type": "integer", "minimum": 1, "maximum": max(ctx - 1, 1)},
                "Keep only the last k prompt tokens (vLLM extra); without it a prompt longer "
                "than the context is a 400.",
            ),
            "user": _nullable({"type": "string"}, "Accepted and ignored."),
        },
    }
    predict = {
        "type": "object",
        "additionalProperties": False,
        "required": ["prompt"],
        "properties": {"prompt": text, **sampling},
    }
    return {"CompletionRequest": completion, "PredictRequest": predict}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _completion(required: list[str], finish_reasons: list) -> dict:
    """A completion object (whole, or one streamed chunk)."""
    choice = {
        "type": "object",
        "required": ["index", "text", "logprobs", "finish_reason"],
        "properties": {
            "index": {"type": "integer"},
            "text": {"type": "string"},
            "logprobs": _ref("Logprobs"),
            "finish_reason": {"enum": finish_reasons},
        },
    }
    return {
        "type": "object",
        "required": required,
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "text_completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": _ref("Usage"),
        },
    }


_RESPONSE_SCHEMAS = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    },
    "Usage": {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
        "properties": {
            k: {"type": "integer", "minimum": 0}
            for k in ("prompt_tokens", "completion_tokens", "total_tokens")
        },
    },
    "Logprobs": {
        "type": ["object", "null"],
        "properties": {
            "tokens": {"type": "array", "items": {"type": "string"}},
            "token_logprobs": {"type": "array", "items": {"type": "number"}},
            "top_logprobs": {
                "type": "array",
                "items": {"type": "object", "additionalProperties": {"type": "number"}},
            },
            "text_offset": {"type": "array", "items": {"type": "integer"}},
        },
    },
    "Completion": _completion(
        ["id", "object", "created", "model", "choices", "usage"], ["stop", "length", "abort"]
    ),
    # A streamed chunk: finish_reason stays null until the choice's last chunk.
    "CompletionChunk": _completion(
        ["id", "object", "created", "model", "choices"], ["stop", "length", "abort", None]
    ),
    "StreamEvent": {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {"contentMediaType": "application/json", "contentSchema": _ref("CompletionChunk")},
                ]
            }
        },
        "description": "One server-sent event: a chunk (`usage` only in the last, with "
        "stream_options.include_usage), then `[DONE]`.",
    },
    "Prediction": {
        "type": "object",
        "required": ["completion", "model", "prompt_tokens", "completion_tokens", "finish_reason"],
        "properties": {
            "completion": {"type": "string"},
            "model": {"type": "string"},
            "prompt_tokens": {"type": "integer"},
            "completion_tokens": {"type": "integer"},
            "finish_reason": {"enum": ["stop", "length", "abort"]},
        },
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["id", "object", "created", "owned_by"],
                    "properties": {
                        "id": {"type": "string"},
                        "object": {"const": "model"},
                        "created": {"type": "integer"},
                        "owned_by": {"type": "string"},
                        "max_model_len": {"type": "integer"},
                        "version": {"type": ["string", "null"]},
                        "run_id": {"type": ["string", "null"]},
                        "source": {"type": "string"},
                    },
                },
            },
        },
    },
    "Status": {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}},
}


def _json(schema_name: str, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _ref(schema_name)}}}


def _errors(*statuses: int) -> dict:
    texts = {
        400: "Invalid value (`param` names the field) or body not JSON",
        401: "Missing or wrong bearer token",
        404: "Unknown model",
        413: "Body over the size limit",
        415: "Body is not application/json",
        429: "Queue full; retry after `Retry-After` seconds",
        503: "Model not loaded yet, or shutting down",
    }
    out = {str(s): _json("Error", texts[s]) for s in statuses}
    if "429" in out:
        out["429"]["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "required": True}}
    return out


def build_document(limits: Limits | None, api_key: bool) -> dict:
    def json_body(name: str) -> dict:
        return {"required": True, "content": {"application/json": {"schema": _ref(name)}}}

    secured = {"security": [{"bearer": []}]} if api_key else {}
    auth = (401,) if api_key else ()
    completion_ok = {
        "description": "The completion, or with `stream: true` server-sent events",
        "content": {
            "application/json": {"schema": _ref("Completion")},
            "text/event-stream": {"schema": _ref("StreamEvent")},
        },
    }
    paths = {
        "/v1/completions": {
            "post": {
                "summary": "OpenAI-compatible text completion",
                **secured,
                "requestBody": json_body("CompletionRequest"),
                "responses": {"200": completion_ok, **_errors(400, *auth, 404, 413, 415, 429, 503)},
            }
        },
        "/predict": {
            "post": {
                "summary": "The simple form: a prompt in, a completion out",
                **secured,
                "requestBody": json_body("PredictRequest"),
                "responses": {
                    "200": _json("Prediction", "The completion"),
                    **_errors(400, *auth, 413, 415, 429, 503),
                },
            }
        },
        "/v1/models": {
            "get": {
                "summary": "The served model, with registry version and run id",
                **secured,
                "responses": {"200": _json("ModelList", "Models"), **_errors(*auth, 503)},
            }
        },
        "/health": {
            "get": {
                "summary": "Liveness: process up, engine loop not stuck",
                "responses": {
                    "200": _json("Status", "Alive"),
                    "503": _json("Error", "Engine loop stuck or failed"),
                },
            }
        },
        "/ready": {
            "get": {
                "summary": "Readiness: model loaded and warmed up, not draining",
                "responses": {"200": _json("Status", "Ready"), **_errors(503)},
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics: engine and HTTP",
                "responses": {
                    "200": {
                        "description": "Prometheus text format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "responses": {
                    "200": {
                        "description": "OpenAPI 3.1",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    }
                },
            }
        },
    }
    components = {"schemas": {**request_schemas(limits), **_RESPONSE_SCHEMAS}}
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "lmops inference service", "version": "1.0.0"},
        "paths": paths,
        "components": components,
    }


class RequestValidator:
    """Validates a body against one request schema of the document; the first
    error becomes a 400 naming the field."""

    def __init__(self, limits: Limits | None):
        schemas = request_schemas(limits)
        self._validators = {name: Draft202012Validator(s) for name, s in schemas.items()}

    def __call__(self, name: str, body: object) -> dict:
        error = best_match(self._validators[name].iter_errors(body))
        if error is None:
            return body  # type: ignore[return-value]
        path = [str(p) for p in error.absolute_path]
        if not path and error.validator in ("required", "additionalProperties"):
            quoted = re.findall(r"'([^']*)'", error.message)
            path = quoted[:1]
        param = path[0] if path else None
        where = ".".join(path) if path else "body"
        message = error.message if len(error.message) <= 200 else error.message[:200] + "..."
        raise APIError(400, f"{where}: {message}", code="invalid_value", param=param)
