"""From a validated request body to engine requests, and from their outputs to
OpenAI's completion objects: one JSON body, or server-sent events."""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from lmops.engine import PromptTooLongError, QueueFullError, SamplingParams
from production_service.errors import APIError, error_body

DEFAULT_MAX_TOKENS = 16
_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "seed",
    "logprobs",
    "ignore_eos",
)
_INT_FIELDS = ("n", "top_k", "seed", "logprobs")


@dataclass
class RequestStats:
    """What the access log and the HTTP metrics need from a request, filled as it runs."""

    request_id: str
    start: float = field(default_factory=time.perf_counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float | None = None
    error: str | None = None
    disconnected: bool = False

    def on_tokens(self, count: int) -> None:
        if count and self.ttft is None:
            self.ttft = time.perf_counter() - self.start
        self.completion_tokens += count


@dataclass
class Job:
    """One prompt's engine request (its n completions)."""

    prompt_text: str
    stream: object


def _is_token(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def encode_prompts(tokenizer, prompt, truncate: int | None) -> list[tuple[str, list[int]]]:
    """(text, token ids) per prompt, tokenized as the engine does, left-truncated
    only when `truncate_prompt_tokens` asks for it. (JSON Schema's integers
    include 1.0, hence the int().)"""
    if isinstance(prompt, str) or _is_token(prompt[0]):
        prompt = [prompt]
    out = []
    for p in prompt:
        ids = (
            [int(t) for t in p] if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=False).ids
        )
        text = p if isinstance(p, str) else None
        if truncate is not None and len(ids) > truncate:
            ids, text = ids[-truncate:], None
        out.append((tokenizer.decode(ids) if text is None else text, ids))
    return out


def sampling_params(body: dict) -> SamplingParams:
    """The engine caps max_tokens at the room the context leaves after the prompt."""
    kwargs = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    kwargs.update({k: int(kwargs[k]) for k in _INT_FIELDS if k in kwargs})
    if "stop_token_ids" in kwargs:
        kwargs["stop_token_ids"] = [int(t) for t in kwargs["stop_token_ids"]]
    kwargs["max_tokens"] = int(body.get("max_tokens") or DEFAULT_MAX_TOKENS)
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        param = next((f for f in _SAMPLING_FIELDS if str(exc).startswith(f)), None)
        raise APIError(400, str(exc), code="invalid_value", param=param) from None


def submit(runtime, body: dict, stats: RequestStats) -> list[Job]:
    """Submit every prompt, or none: a failure cancels what was already submitted."""
    params = sampling_params(body)
    truncate = body.get("truncate_prompt_tokens")
    prompts = encode_prompts(
        runtime.engine.tokenizer, body["prompt"], None if truncate is None else int(truncate)
    )
    jobs: list[Job] = []
    try:
        for text, ids in prompts:
            jobs.append(Job(text, runtime.loop.submit(ids, params)))
            stats.prompt_tokens += len(ids)
    except QueueFullError:
        raise APIError(
            429, "The server's queue is full; retry shortly.", code="queue_full", headers={"Retry-After": "1"}
        ) from None
    except PromptTooLongError as exc:
        raise APIError(
            400,
            f"{exc}; shorten it or set truncate_prompt_tokens.",
            code="context_length_exceeded",
            param="prompt",
        ) from None
    except ValueError as exc:
        param = "n" if str(exc).startswith("n ") else "prompt"
        raise APIError(400, str(exc), code="invalid_value", param=param) from None
    except RuntimeError as exc:
        draining = runtime.state in ("draining", "stopped")
        raise APIError(
            503,
            "The server is shutting down." if draining else f"The engine is not accepting requests ({exc}).",
            code="shutting_down" if draining else "engine_unavailable",
        ) from None
    finally:
        if len(jobs) < len(prompts):
            for job in jobs:
                job.stream.cancel()
    return jobs


def _logprob(value: float) -> float:
    """-inf is not JSON; vLLM's floor."""
    return max(float(value), -9999.0)


def _logprobs(tok, entries: list[dict] | None, offset: int) -> dict | None:
    """The engine's per-token logprobs in OpenAI's legacy completions shape."""
    if entries is None:
        return None
    tokens = [tok.decode([e["token_id"]]) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [_logprob(e["logprob"]) for e in entries],
        "top_logprobs": [
            {tok.decode([int(t)]): _logprob(lp) for t, lp in (e.get("top") or {}).items()} for e in entries
        ],
        "text_offset": offsets,
    }


def _head(completion_id: str, model: str, created: int) -> dict:
    return {"id": completion_id, "object": "text_completion", "created": created, "model": model}


def _usage(stats: RequestStats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
    }


def complete(runtime, jobs: list[Job], body: dict, stats: RequestStats, completion_id: str) -> dict:
    """Wait for every job; the OpenAI completion object."""
    tok, n, echo = runtime.engine.tokenizer, int(body.get("n") or 1), bool(body.get("echo"))
    choices = []
    done = False
    try:
        for i, job in enumerate(jobs):
            final = {}
            for out in job.stream:
                for co in out.outputs:
                    final[co.index] = co
                    stats.on_tokens(len(co.delta_token_ids))
            prefix = job.prompt_text if echo else ""
            choices += [
                {
                    "index": i * n + co.index,
                    "text": prefix + co.text,
                    "logprobs": _logprobs(tok, co.logprobs, len(prefix)),
                    "finish_reason": co.finish_reason,
                }
                for co in final.values()
            ]
        done = True
    except RuntimeError as exc:  # the engine loop died under this request
        raise APIError(500, str(exc), code="engine_failed") from None
    finally:
        if not done:
            for job in jobs:
                job.stream.cancel()
    return {
        **_head(completion_id, runtime.model.name, int(time.time())),
        "choices": choices,
        "usage": _usage(stats),
    }


def _latest(stream, out):
    """The newest output already waiting (outputs are cumulative): a client that
    reads slower than the engine writes gets fewer, larger events, not a backlog."""
    while not out.finished:
        try:
            out = stream.get(timeout=0) or out
        except queue.Empty:
            break
    return out


def stream_events(
    runtime, jobs: list[Job], body: dict, stats: RequestStats, completion_id: str
) -> Iterator[str]:
    """Server-sent events, one per new piece of text; a client that goes away
    (the server closes this generator) aborts every job and frees its KV blocks."""
    tok, n, echo = runtime.engine.tokenizer, int(body.get("n") or 1), bool(body.get("echo"))
    head = json.dumps(_head(completion_id, runtime.model.name, int(time.time())))[:-1]
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    done = False
    try:
        for i, job in enumerate(jobs):
            counted: dict[int, int] = {}  # per choice: tokens counted, and tokens/chars sent
            sent: dict[int, tuple[int, int]] = {}
            finished: set[int] = set()
            while (out := job.stream.get()) is not None:
                choices = []
                for co in _latest(job.stream, out).outputs:
                    stats.on_tokens(len(co.token_ids) - counted.get(co.index, 0))
                    counted[co.index] = len(co.token_ids)
                    first = co.index not in sent
                    tokens, chars = sent.get(co.index, (0, 0))
                    delta = co.text[chars:]
                    if co.index in finished or not (delta or co.finish_reason or first and echo):
                        continue
                    if co.finish_reason:
                        finished.add(co.index)
                    prefix = job.prompt_text if echo and first else ""
                    offset = chars + (len(job.prompt_text) if echo else 0)
                    entries = None if co.logprobs is None else co.logprobs[tokens:]
                    sent[co.index] = (len(co.token_ids), len(co.text))
                    choices.append(
                        {
                            "index": i * n + co.index,
                            "text": prefix + delta,
                            "logprobs": _logprobs(tok, entries, offset),
                            "finish_reason": co.finish_reason,
                        }
                    )
                if choices:
                    yield f'data: {head}, "choices": {json.dumps(choices)}}}\n\n'
        if include_usage:
            yield f'data: {head}, "choices": [], "usage": {json.dumps(_usage(stats))}}}\n\n'
        yield "data: [DONE]\n\n"
        done = True
    except RuntimeError as exc:  # the engine loop died mid-stream: the status is sent, say it in-band
        stats.error, done = "engine_failed", True
        yield f"data: {json.dumps(error_body(500, str(exc), 'engine_failed'))}\n\n"
    finally:
        if not done:  # the client went away (or the engine failed): free the engine's work
            stats.disconnected = True
            for job in jobs:
                job.stream.cancel()
