"""The sampling fields the API accepts are SamplingParams' own, and a request sets them on
top of the model's defaults (its generation_config.json and LMOPS_GENERATION_CONFIG),
which the service merges and checks once, at load."""

from __future__ import annotations

import dataclasses
import time

from lmops.runtime.engine import SamplingParams
from production_service.app import create_app
from production_service.completions import sampling_params
from production_service.schemas import UNLOADED, request_models, validate
from production_service.settings import ServiceConfig

SAMPLING = {f.name for f in dataclasses.fields(SamplingParams)}
# The request fields that are not SamplingParams fields (priority: the scheduler's).
SHARED = {"model", "stream", "stream_options", "user", "response_format", "priority"}
COMPLETION_ONLY = {"prompt", "echo", "truncate_prompt_tokens"}
CHAT_ONLY = {
    "messages",
    "add_generation_prompt",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
}
MESSAGES = [{"role": "user", "content": "hi"}]


def test_the_request_models_declare_exactly_the_sampling_fields():
    """A field added to SamplingParams is one the API accepts, and a request field is
    either a SamplingParams field or one of the known others."""
    models = request_models(UNLOADED)
    assert set(models.completion.model_fields) == SAMPLING | SHARED | COMPLETION_ONLY
    # chat spells log-probs its own way (a boolean logprobs, top_logprobs) and scores no prompt
    assert set(models.chat.model_fields) == SAMPLING - {"prompt_logprobs"} | SHARED | CHAT_ONLY
    assert set(models.predict.model_fields) - {"prompt"} <= SAMPLING


def test_a_request_sets_its_fields_on_top_of_the_model_defaults():
    models = request_models(UNLOADED)
    defaults = SamplingParams(temperature=0.0, top_k=50, max_tokens=128)
    body = validate(models.completion, {"prompt": "a", "top_k": 5, "stop": "x", "logit_bias": {"3": 1}})
    p = sampling_params(body, defaults)
    assert (p.temperature, p.top_k, p.max_tokens, p.stop, p.logit_bias) == (0.0, 5, 128, ["x"], {3: 1})
    body = {
        "messages": MESSAGES,
        "max_tokens": 9,
        "max_completion_tokens": 7,
        "logprobs": True,
        "top_logprobs": 2,
    }
    p = sampling_params(validate(models.chat, body), defaults)
    assert (p.max_tokens, p.logprobs, p.top_k) == (7, 2, 50)
    assert defaults == SamplingParams(temperature=0.0, top_k=50, max_tokens=128)


def test_an_invalid_deployment_default_fails_the_load_naming_it(model_dir):
    app = create_app(ServiceConfig(model_dir=model_dir, device="cpu", generation_config={"temperature": 5}))
    runtime = app.extensions["lmops"]
    deadline = time.monotonic() + 30
    while runtime.state == "loading" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runtime.state == "failed"
    assert "LMOPS_GENERATION_CONFIG: temperature must be" in runtime.error and "\n" not in runtime.error
