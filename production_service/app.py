"""The Flask app: OpenAI-compatible /v1/completions and /v1/models, the simple
/predict, probes, /metrics and /openapi.json, over one engine loop per process.

gunicorn runs `create_app()` in its (single) worker, so the engine and its
background loop live there and every request of the replica joins one
continuous batch.
"""

from __future__ import annotations

import functools
import hmac
import json
import re
import uuid

from flask import Flask, Response, g, jsonify, request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from production_service import completions, errors
from production_service.config import ServiceConfig
from production_service.errors import APIError
from production_service.observability import HttpMetrics, configure_logging
from production_service.openapi import RequestValidator, build_document
from production_service.runtime import Runtime

_MODEL_ENDPOINTS = {"completions", "predict", "models"}
_REQUEST_ID = re.compile(r"[\w.:/+=@-]{1,128}")


def create_app(config: ServiceConfig | None = None, *, start: bool = True) -> Flask:
    """Build the app; with `start`, begin loading the model in the background."""
    config = config or ServiceConfig.from_env()
    configure_logging()
    runtime = Runtime(config)
    http = HttpMetrics(lambda: runtime.ready)
    validator = functools.lru_cache(maxsize=2)(RequestValidator)
    document = functools.lru_cache(maxsize=2)(build_document)

    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.json.sort_keys = False
    app.extensions["lmops"] = runtime
    errors.register(app)

    @app.before_request
    def _begin():
        rid = request.headers.get("X-Request-ID", "")
        g.stats = completions.RequestStats(rid if _REQUEST_ID.fullmatch(rid) else uuid.uuid4().hex)
        if request.endpoint not in _MODEL_ENDPOINTS:
            return
        if config.api_key is not None:
            _authorize(config.api_key)
        if runtime.state in ("draining", "stopped"):
            raise APIError(503, "The server is shutting down.", code="shutting_down")
        if not runtime.ready:
            raise APIError(
                503,
                "The model is not loaded yet." if runtime.state == "loading" else "The model failed to load.",
                code="not_ready",
            )

    @app.after_request
    def _end(response: Response):
        stats = g.get("stats") or completions.RequestStats(uuid.uuid4().hex)
        response.headers["X-Request-ID"] = stats.request_id
        if response.status_code >= 400 and response.is_json:
            stats.error = ((response.get_json(silent=True) or {}).get("error") or {}).get("code")
        handler = request.url_rule.rule if request.url_rule else "unmatched"
        response.call_on_close(
            functools.partial(http.finish, stats, request.method, request.path, handler, response.status_code)
        )
        return response

    def validated(schema: str) -> dict:
        body = validator(runtime.limits)(schema, _json_body())
        model = body.get("model")
        if model is not None and model != runtime.model.name:
            raise APIError(
                404,
                f"The model {model!r} does not exist; this server serves {runtime.model.name!r}.",
                code="model_not_found",
                param="model",
            )
        return body

    @app.post("/v1/completions", endpoint="completions")
    def _completions():
        body = validated("CompletionRequest")
        jobs = completions.submit(runtime, body, g.stats)
        completion_id = f"cmpl-{g.stats.request_id}"
        if body.get("stream"):
            events = completions.stream_events(runtime, jobs, body, g.stats, completion_id)
            return Response(
                events,
                mimetype="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return jsonify(completions.complete(runtime, jobs, body, g.stats, completion_id))

    @app.post("/predict", endpoint="predict")
    def _predict():
        body = validated("PredictRequest")
        jobs = completions.submit(runtime, body, g.stats)
        result = completions.complete(runtime, jobs, body, g.stats, f"cmpl-{g.stats.request_id}")
        choice = result["choices"][0]
        return jsonify(
            {
                "completion": choice["text"],
                "model": result["model"],
                "prompt_tokens": g.stats.prompt_tokens,
                "completion_tokens": g.stats.completion_tokens,
                "finish_reason": choice["finish_reason"],
            }
        )

    @app.get("/v1/models", endpoint="models")
    def _models():
        m = runtime.model
        return jsonify(
            {
                "object": "list",
                "data": [
                    {
                        "id": m.name,
                        "object": "model",
                        "created": runtime.created,
                        "owned_by": "lmops",
                        "max_model_len": runtime.limits.max_model_len,
                        "version": m.version,
                        "run_id": m.run_id,
                        "source": m.source,
                    }
                ],
            }
        )

    @app.get("/health")
    def _health():
        if runtime.healthy():
            return jsonify({"status": runtime.state})
        raise APIError(503, runtime.error or "The engine loop has failed or is stuck.", code="unhealthy")

    @app.get("/ready")
    def _ready():
        if runtime.ready:
            return jsonify({"status": "ready"})
        raise APIError(503, f"Not ready: {runtime.state}.", code="not_ready")

    @app.get("/metrics")
    def _metrics():
        text = generate_latest(http.registry)
        if runtime.engine is not None:
            text += generate_latest(runtime.engine.metrics.registry)
        return Response(text, mimetype=CONTENT_TYPE_LATEST.split(";")[0], content_type=CONTENT_TYPE_LATEST)

    @app.get("/openapi.json")
    def _openapi():
        return jsonify(document(runtime.limits, config.api_key is not None))

    if start:
        runtime.start()
    return app


def _authorize(key: str) -> None:
    """Bearer token, compared in constant time."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if not (scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())):
        raise APIError(
            401,
            "Missing or wrong API key: send `Authorization: Bearer <key>`.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def _no_constants(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _json_body() -> object:
    """The body as JSON: 415 for another media type, 400 when it does not parse."""
    if request.mimetype != "application/json" and not request.mimetype.endswith("+json"):
        raise APIError(
            415,
            f"Content-Type must be application/json, got {request.mimetype or 'none'!r}.",
            code="unsupported_media_type",
        )
    try:
        body = json.loads(request.get_data(cache=False), parse_constant=_no_constants)
        json.dumps(body, ensure_ascii=False).encode("utf-8")  # lone surrogates cannot be tokenized
    except (ValueError, RecursionError, UnicodeError) as exc:
        raise APIError(400, f"The body is not valid JSON: {exc}", code="invalid_json") from None
    return body
