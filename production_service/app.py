"""The Flask app: OpenAI-compatible /v1/completions, /v1/chat/completions and
/v1/models, vLLM's /tokenize and /detokenize, and the simple /predict (the `api` blueprint), and /health, /ready, /metrics, /openapi.json (the
`ops` blueprint), over one engine loop per process.

gunicorn runs `create_app()` in its (single) worker, so the engine and its
background loop live there and every request of the replica joins one
continuous batch. The `ops` endpoints are also served on their own probe port
(`probe_app`), so probes answer while every API thread is busy. With an API key,
everything on the API port but /health and /ready needs it; the probe port, which
only the cluster reaches (the NetworkPolicy), serves /metrics to Prometheus without.
"""

from __future__ import annotations

import functools
import json
import re
import select
import socket
import uuid

from flask import Blueprint, Flask, Response, current_app, g, jsonify, request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from production_service import chat, completions, errors, structured
from production_service.errors import APIError
from production_service.observability import HttpMetrics, RequestStats, configure_logging
from production_service.runtime import Runtime
from production_service.schemas import (
    UNLOADED,
    Detokenized,
    ModelCard,
    ModelList,
    Prediction,
    Rendered,
    Tokens,
    build_document,
    check_fields,
    request_models,
    validate,
)
from production_service.settings import ServiceConfig

_REQUEST_ID = re.compile(r"[\w.:/+=@-]{1,128}")
MODEL_VERSION_HEADER = "X-Model-Version"  # the registry version of the model that answered
# The priority of the InferenceObjective a request came through, which the gateway's
# route sets (deploy/gateway/httproute.yaml): the objective's sense, higher first.
OBJECTIVE_PRIORITY_HEADER = "X-Lmops-Objective-Priority"

api = Blueprint("api", __name__)
ops = Blueprint("ops", __name__)


def create_app(config: ServiceConfig | None = None, *, start: bool = True) -> Flask:
    """Build the app; with `start`, begin loading the model in the background."""
    config = config or ServiceConfig.from_env()
    configure_logging()
    runtime = Runtime(config)
    app = _flask(runtime, HttpMetrics(lambda: runtime.ready), api, ops)
    if config.api_key is not None:
        app.before_request(_authorize)
    if start:
        app.extensions["lmops"].start()
    return app


def probe_app(app: Flask, api_answers=None) -> Flask:
    """The `ops` endpoints of `app` alone, sharing its runtime and metrics, no key needed:
    what the probe port serves. `api_answers()` says whether the API port takes a request;
    /ready fails when it does not."""
    probe = _flask(app.extensions["lmops"], app.extensions["lmops.http"], ops)
    probe.extensions["lmops.api_answers"] = api_answers
    return probe


def _flask(runtime: Runtime, http: HttpMetrics, *blueprints: Blueprint) -> Flask:
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = runtime.config.max_body_bytes
    app.json.sort_keys = False
    app.extensions["lmops"], app.extensions["lmops.http"] = runtime, http
    errors.register(app)
    app.before_request(_begin)
    app.after_request(_end)
    for blueprint in blueprints:
        app.register_blueprint(blueprint)
    return app


def _runtime() -> Runtime:
    return current_app.extensions["lmops"]


def _begin() -> None:
    rid = request.headers.get("X-Request-ID", "")
    g.stats = RequestStats(rid if _REQUEST_ID.fullmatch(rid) else uuid.uuid4().hex)


def _end(response: Response) -> Response:
    stats = g.get("stats") or RequestStats(uuid.uuid4().hex)
    response.headers["X-Request-ID"] = stats.request_id
    served = g.pop("served", None)
    if served is not None:  # a model request: which version answered, and its pin let go at the end
        if served.model.version is not None:
            response.headers[MODEL_VERSION_HEADER] = served.model.version
        response.call_on_close(served.release)
    if response.status_code >= 400 and response.is_json:
        stats.error = ((response.get_json(silent=True) or {}).get("error") or {}).get("code")
    handler = request.url_rule.rule if request.url_rule else "unmatched"
    http = current_app.extensions["lmops.http"]
    response.call_on_close(
        functools.partial(http.finish, stats, request.method, request.path, handler, response.status_code)
    )
    return response


# -- the model endpoints ---------------------------------------------------------------


@api.before_request
def _admit() -> None:
    """A model that is ready to take the request, and room in the queue: a full queue is a
    429 before the body is parsed or tokenized, so clients retrying fast cost the served
    ones little (submit still refuses what does not fit; under gunicorn the worker answers
    most of them before the app, production_service/worker.py)."""
    runtime = _runtime()
    if runtime.state in ("draining", "stopped"):
        raise APIError(503, "The server is shutting down.", code="shutting_down")
    if not runtime.ready:
        raise APIError(
            503,
            "The model is not loaded yet." if runtime.state == "loading" else "The model failed to load.",
            code="not_ready",
        )
    if request.endpoint in _QUEUED_ENDPOINTS and runtime.loop.num_waiting >= runtime.loop.max_queued:
        raise completions.queue_full()


_QUEUED_ENDPOINTS = ("api.completions", "api.predict")


_OPEN_ENDPOINTS = ("ops._health", "ops._ready")  # what load balancers and kubelets call


def _authorize() -> None:
    """Bearer token, compared in constant time, on everything but the probes (an unknown
    path too: a 401, not a map of what exists)."""
    if request.endpoint in _OPEN_ENDPOINTS:
        return
    if not _runtime().config.authorizes(request.headers.get("Authorization", "")):
        raise APIError(
            401,
            "Missing or wrong API key: send `Authorization: Bearer <key>`.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def _validated(endpoint: str):
    """The model the body names (pinned for the request: `Runtime.pin`), and the body as
    the endpoint's request model (schemas.RequestModels' field) for that model, sized
    against its context before anything looks at it item by item."""
    runtime = _runtime()
    body = _json_body(runtime.config.max_body_bytes)
    model = body.get("model") if isinstance(body, dict) else None
    served = runtime.pin(model if isinstance(model, str) else None)
    if served is None:
        ids = [s.id for s in runtime.served.values()]
        raise APIError(
            404,
            f"The model {model!r} does not exist; this server serves {' and '.join(map(repr, ids))}.",
            code="model_not_found",
            param="model",
        )
    g.served = served
    completions.check_prompt_size(body, served.limits)
    request_model = getattr(request_models(served.limits), endpoint)
    structured.reject_guided(body)
    check_fields(request_model, body)
    return served, _with_objective_priority(validate(request_model, body), served.limits)


def _with_objective_priority(body, limits):
    """The gateway's objective priority as the request's, in vLLM's sense (lower runs
    first: the negation); it wins over a `priority` in the body, which the client chose."""
    value = request.headers.get(OBJECTIVE_PRIORITY_HEADER)
    if value is None or not hasattr(body, "priority"):
        return body
    try:
        objective = int(value)
    except ValueError:
        objective = None
    if objective is None or not -(2**31) <= objective < 2**31:
        raise APIError(
            400,
            f"{OBJECTIVE_PRIORITY_HEADER} must be an InferenceObjective's priority (a 32-bit integer), got {value!r}.",
            code="invalid_value",
        )
    if objective != 0 and not limits.priority_scheduling:
        raise APIError(
            400,
            f"{OBJECTIVE_PRIORITY_HEADER} {objective} needs priority scheduling (LMOPS_SCHEDULING_POLICY=priority).",
            code="invalid_value",
        )
    return body.model_copy(update={"priority": -objective})


@api.post("/v1/completions", endpoint="completions")
def _completions():
    stats = g.stats
    served, body = _validated("completion")
    jobs = completions.submit(_runtime(), served, body, stats, completions.encode_prompts(served, body))
    return _answer(completions.TextFormat(served, body, f"cmpl-{stats.request_id}"), jobs, body, stats)


@api.post("/v1/chat/completions", endpoint="chat_completions")
def _chat_completions():
    stats = g.stats
    served, body = _validated("chat")
    jobs = completions.submit(_runtime(), served, body, stats, chat.encode_messages(served, body))
    return _answer(chat.ChatFormat(served, f"chatcmpl-{stats.request_id}", body), jobs, body, stats)


def _answer(fmt, jobs, body, stats):
    """The jobs' answer in `fmt`: server-sent events with `stream`, else one body."""
    if body.stream:
        return Response(
            completions.stream_events(fmt, jobs, body, stats),
            mimetype="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return _json(completions.complete(fmt, jobs, stats, _client_gone(), n=body.n or 1))


@api.post("/predict", endpoint="predict")
def _predict():
    stats = g.stats
    served, body = _validated("predict")
    jobs = completions.submit(_runtime(), served, body, stats, completions.encode_prompts(served, body))
    fmt = completions.TextFormat(served, body, f"cmpl-{stats.request_id}")
    done = completions.complete(fmt, jobs, stats, _client_gone())
    [choice] = done.choices
    return _json(
        Prediction(
            completion=choice.text,
            model=done.model,
            prompt_tokens=stats.prompt_tokens,
            completion_tokens=stats.completion_tokens,
            finish_reason=choice.finish_reason,
        )
    )


@api.post("/tokenize", endpoint="tokenize")
def _tokenize():
    """vLLM's: a prompt (special tokens added unless add_special_tokens is false) or chat
    messages (rendered by the chat template, as /v1/chat/completions does)."""
    served, body = _validated("tokenize")
    if body.messages is not None:
        text, add_special = chat.render_messages(served, body.messages, body.add_generation_prompt), False
    else:
        text, add_special = body.prompt, True
    add_special = add_special if body.add_special_tokens is None else body.add_special_tokens
    tok = served.engine.tokenizer
    ids = tok.encode(text, add_special_tokens=add_special).ids
    strs = [tok.id_to_token(i) for i in ids] if body.return_token_strs else None
    return _json(
        Tokens(count=len(ids), max_model_len=served.limits.max_model_len, tokens=ids, token_strs=strs)
    )


@api.post("/detokenize", endpoint="detokenize")
def _detokenize():
    served, body = _validated("detokenize")
    return _json(Detokenized(prompt=served.engine.tokenizer.decode(body.tokens, skip_special_tokens=False)))


@api.get("/v1/models", endpoint="models")
def _models():
    """Every model served, the champion first; `created` is when each version began serving."""
    cards = [
        ModelCard(
            id=s.id,
            created=s.created,
            max_model_len=s.limits.max_model_len,
            version=s.model.version,
            run_id=s.model.run_id,
            source=s.model.source,
        )
        for s in list(_runtime().served.values())
    ]
    return _json(ModelList(data=cards))


# -- probes, metrics, the document ---------------------------------------------------------


@ops.get("/health")
def _health():
    runtime = _runtime()
    if runtime.healthy():
        return jsonify({"status": runtime.state})
    raise APIError(503, runtime.error or "The engine loop has failed or is stuck.", code="unhealthy")


@ops.get("/ready")
def _ready():
    runtime = _runtime()
    if not runtime.ready:
        raise APIError(503, f"Not ready: {runtime.state}.", code="not_ready")
    api_answers = current_app.extensions.get("lmops.api_answers")
    if api_answers is not None and not api_answers():
        raise APIError(
            503, "Not ready: the API port does not answer (every request thread is taken).", code="not_ready"
        )
    return jsonify({"status": "ready"})


@ops.get("/metrics")
def _metrics():
    runtime = _runtime()
    text = generate_latest(current_app.extensions["lmops.http"].registry)
    text += generate_latest(runtime.metrics.registry)
    if runtime.engine is not None:
        text += generate_latest(runtime.engine.metrics.registry)
    return Response(text, mimetype=CONTENT_TYPE_LATEST.split(";")[0], content_type=CONTENT_TYPE_LATEST)


@ops.post("/v1/completions/render")
def _render_completions():
    """vLLM's render: the token ids each prompt of a completion request becomes, what
    llm-d's token producer asks for (the precise prefix-cache scorer hashes them). On
    the probe port, which only the cluster reaches, the picker needs no API key."""
    _ready_runtime()
    served, body = _validated("completion")
    rendered = [Rendered(token_ids=ids) for _, ids in completions.encode_prompts(served, body)]
    return Response(json.dumps([r.model_dump() for r in rendered]), mimetype="application/json")


@ops.post("/v1/chat/completions/render")
def _render_chat():
    """vLLM's render of a chat request: its one prompt's token ids, as the chat template writes it."""
    _ready_runtime()
    [(_, ids)] = chat.encode_messages(*_validated("chat"))
    return _json(Rendered(token_ids=ids))


def _ready_runtime() -> Runtime:
    runtime = _runtime()
    if not runtime.ready:
        raise APIError(503, f"Not ready: {runtime.state}.", code="not_ready")
    return runtime


@ops.get("/openapi.json")
def _openapi():
    runtime = _runtime()
    return jsonify(build_document(runtime.limits or UNLOADED, runtime.config.api_key is not None))


# -- helpers ---------------------------------------------------------------------------


def _json(model) -> Response:
    return Response(model.model_dump_json(), mimetype="application/json")


def _client_gone():
    """A check whether the client closed its connection (readable with nothing to
    read); always False outside gunicorn (no socket in the environ)."""
    sock = request.environ.get("gunicorn.socket")

    def gone() -> bool:
        if sock is None:
            return False
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    return gone


def _no_constants(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _json_body(limit: int) -> object:
    """The body as JSON: 415 for another media type, 413 over the limit (a chunked
    body too: werkzeug would silently cut it at the limit), 400 when it does not parse."""
    if request.mimetype != "application/json" and not request.mimetype.endswith("+json"):
        raise APIError(
            415,
            f"Content-Type must be application/json, got {request.mimetype or 'none'!r}.",
            code="unsupported_media_type",
        )
    if request.content_length is None and request.environ.get("wsgi.input_terminated"):
        data = request.environ["wsgi.input"].read(limit + 1)
        if len(data) > limit:
            raise APIError(413, f"The body is over the {limit}-byte limit.", code="request_too_large")
    else:
        data = request.get_data(cache=False)
    try:
        body = json.loads(data, parse_constant=_no_constants)
        json.dumps(body, ensure_ascii=False).encode("utf-8")  # lone surrogates cannot be tokenized
    except (ValueError, RecursionError, UnicodeError) as exc:
        raise APIError(400, f"The body is not valid JSON: {exc}", code="invalid_json") from None
    return body
