"""From a validated request to engine requests, and from their outputs to
OpenAI's completion objects: one JSON body, or server-sent events."""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from lmops.runtime.engine import (
    CompletionOutput,
    PromptTooLongError,
    QueueFullError,
    RequestOutput,
    SamplingParams,
)
from production_service.errors import APIError, error_body
from production_service.observability import RequestStats
from production_service.schemas import (
    MAX_PROMPTS,
    Choice,
    Completion,
    CompletionChunk,
    Limits,
    Logprobs,
    Usage,
)

# How often a non-streaming request looks whether its client is still there.
DISCONNECT_POLL_S = 0.5
_SAMPLING_FIELDS = (
    "max_tokens",
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


@dataclass
class Job:
    """One prompt's engine request (its n completions)."""

    prompt_text: str
    stream: object


def check_prompt_size(body: object, limits: Limits) -> None:
    """Reject a prompt that cannot fit the context from its length alone, before any
    per-token work: validating or tokenizing a body-limit-sized prompt item by item
    costs seconds of CPU and its memory. A text of more than `max_prompt_chars`
    characters has more tokens than the context holds (unless it is to be truncated)."""
    if not isinstance(body, dict):
        return
    prompt = body.get("prompt")
    truncate = body.get("truncate_prompt_tokens") is not None
    if isinstance(prompt, list) and len(prompt) > max(limits.max_prompt_tokens, MAX_PROMPTS):
        raise _too_long(f"prompt has {len(prompt)} items", limits)
    for p in prompt if isinstance(prompt, list) else [prompt]:
        if isinstance(p, list) and len(p) > limits.max_prompt_tokens:
            raise _too_long(f"a prompt has {len(p)} token ids", limits)
        if isinstance(p, str) and len(p) > limits.max_prompt_chars and not truncate:
            raise _too_long(f"a prompt has {len(p)} characters, so more tokens than fit", limits)


def _too_long(what: str, limits: Limits) -> APIError:
    return APIError(
        400,
        f"{what}; this model's context is {limits.max_model_len} tokens, so a prompt may have at "
        f"most {limits.max_prompt_tokens}; shorten it or set truncate_prompt_tokens.",
        code="context_length_exceeded",
        param="prompt",
    )


def encode_prompts(tokenizer, prompt, truncate: int | None, limits: Limits) -> list[tuple[str, list[int]]]:
    """(text, token ids) per prompt, tokenized as the engine does, left-truncated only
    when `truncate_prompt_tokens` asks for it. A text to truncate is tokenized from a
    tail twice as long as any prompt can be, so a huge one costs no more than a long one."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        prompt = [prompt]
    out = []
    for p in prompt:
        if isinstance(p, list):
            ids, text = p, None
        else:
            text = p
            if truncate is not None and len(p) > limits.max_prompt_chars:
                p = p[-2 * limits.max_prompt_chars :]
            ids = tokenizer.encode(p, add_special_tokens=False).ids
        if truncate is not None and len(ids) > truncate:
            ids, text = ids[-truncate:], None
        out.append((tokenizer.decode(ids) if text is None else text, ids))
    return out


def sampling_params(body, generation: dict) -> SamplingParams:
    """What the request sets, on top of the model's generation config (`generation`: its
    generation_config.json and LMOPS_GENERATION_CONFIG). The engine caps max_tokens at the
    room the context leaves after the prompt."""
    kwargs = {k: getattr(body, k) for k in _SAMPLING_FIELDS if getattr(body, k, None) is not None}
    try:
        return SamplingParams.from_generation_config(generation, **kwargs)
    except ValueError as exc:
        param = next((f for f in _SAMPLING_FIELDS if str(exc).startswith(f)), None)
        raise APIError(400, str(exc), code="invalid_value", param=param) from None


def queue_full() -> APIError:
    return APIError(
        429, "The server's queue is full; retry shortly.", code="queue_full", headers={"Retry-After": "1"}
    )


def submit(runtime, body, stats: RequestStats) -> list[Job]:
    """Submit every prompt, or none: a failure cancels what was already submitted."""
    params = sampling_params(body, runtime.generation_config)
    truncate = getattr(body, "truncate_prompt_tokens", None)
    prompts = encode_prompts(runtime.engine.tokenizer, body.prompt, truncate, runtime.limits)
    jobs: list[Job] = []
    try:
        for text, ids in prompts:
            jobs.append(Job(text, runtime.loop.submit(ids, params)))
            stats.prompt_tokens += len(ids)
    except QueueFullError:
        raise queue_full() from None
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


def _logprobs(tok, entries: list[dict] | None, offset: int) -> Logprobs | None:
    """The engine's per-token logprobs in OpenAI's legacy completions shape."""
    if entries is None:
        return None
    tokens = [tok.decode([e["token_id"]]) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return Logprobs(
        tokens=tokens,
        token_logprobs=[_logprob(e["logprob"]) for e in entries],
        top_logprobs=[
            {tok.decode([int(t)]): _logprob(lp) for t, lp in (e.get("top") or {}).items()} for e in entries
        ],
        text_offset=offsets,
    )


def _usage(stats: RequestStats) -> Usage:
    return Usage(
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=stats.completion_tokens,
        total_tokens=stats.prompt_tokens + stats.completion_tokens,
    )


class ClientGone(Exception):
    """The client closed its connection while waiting for a non-streaming answer."""


def _outputs(stream, client_gone: Callable[[], bool]) -> Iterator[RequestOutput]:
    """The stream's outputs; raises ClientGone within DISCONNECT_POLL_S of the client
    going away, however busy the stream is."""
    check_at = time.monotonic() + DISCONNECT_POLL_S
    while True:
        try:
            out = stream.get(timeout=max(check_at - time.monotonic(), 0))
        except queue.Empty:
            out = False
        if out is None:
            return
        if time.monotonic() >= check_at:
            if client_gone():
                raise ClientGone
            check_at = time.monotonic() + DISCONNECT_POLL_S
        if out:
            yield out


def complete(
    runtime,
    jobs: list[Job],
    stats: RequestStats,
    completion_id: str,
    client_gone: Callable[[], bool],
    n: int = 1,
    echo: bool = False,
) -> Completion:
    """Wait for every job (of `n` choices each); a client that goes away aborts them
    all, as a stream's does."""
    tok = runtime.engine.tokenizer
    choices = []
    done = False
    try:
        for i, job in enumerate(jobs):
            final: dict[int, CompletionOutput] = {}
            for out in _outputs(job.stream, client_gone):
                for co in out.outputs:
                    final[co.index] = co
                    stats.on_tokens(len(co.delta_token_ids))
            prefix = job.prompt_text if echo else ""
            choices += [
                Choice(
                    index=i * n + co.index,
                    text=prefix + co.text,
                    logprobs=_logprobs(tok, co.logprobs, len(prefix)),
                    finish_reason=co.finish_reason,
                )
                for co in final.values()
            ]
        done = True
    except ClientGone:
        stats.disconnected = True
        raise APIError(499, "The client closed the connection.", code="client_disconnected") from None
    except RuntimeError as exc:  # the engine loop died under this request
        raise APIError(500, str(exc), code="engine_failed") from None
    finally:
        if not done:
            for job in jobs:
                job.stream.cancel()
    return Completion(
        id=completion_id,
        created=int(time.time()),
        model=runtime.model.name,
        choices=choices,
        usage=_usage(stats),
    )


def _drain(stream, out: RequestOutput) -> list[RequestOutput]:
    """`out` and every output already waiting behind it: a client that reads slower
    than the engine writes gets fewer, larger events, not a backlog."""
    outs = [out]
    while not outs[-1].finished:
        try:
            nxt = stream.get(timeout=0)
        except queue.Empty:
            break
        if nxt is None:
            break
        outs.append(nxt)
    return outs


def _event(data: str) -> str:
    return f"data: {data}\n\n"


def _merge(outs: list[RequestOutput]) -> dict[int, tuple[str, list[int], CompletionOutput]]:
    """Per choice: the new text and token ids of `outs` (the engine's deltas, joined),
    and the choice's latest output."""
    merged: dict[int, tuple[str, list[int], CompletionOutput]] = {}
    for out in outs:
        for co in out.outputs:
            text, ids, _ = merged.get(co.index, ("", [], co))
            merged[co.index] = (text + co.delta_text, ids + co.delta_token_ids, co)
    return merged


@dataclass(frozen=True)
class _Sent:
    """What one streamed choice has sent: characters of text, tokens (with logprobs)."""

    chars: int = 0
    tokens: int = 0
    finished: bool = False


def stream_events(runtime, jobs: list[Job], body, stats: RequestStats, completion_id: str) -> Iterator[str]:
    """Server-sent events, one per batch of new text; a client that goes away (the
    server closes this generator) aborts every job and frees its KV blocks."""
    tok, n, echo = runtime.engine.tokenizer, body.n or 1, bool(body.echo)
    head = {"id": completion_id, "created": int(time.time()), "model": runtime.model.name}
    done = False
    try:
        for i, job in enumerate(jobs):
            prompt_chars = len(job.prompt_text) if echo else 0
            sent: dict[int, _Sent] = {}
            while (out := job.stream.get()) is not None:
                choices = []
                for index, (text, ids, co) in _merge(_drain(job.stream, out)).items():
                    stats.on_tokens(len(ids))
                    was = sent.get(index)
                    if (was and was.finished) or not (text or co.finish_reason or (was is None and echo)):
                        continue  # nothing to say (yet): text held back for a stop string or a partial character
                    prefix = job.prompt_text if echo and was is None else ""
                    was = was or _Sent()
                    entries = None if co.logprobs is None else co.logprobs[was.tokens :]
                    choices.append(
                        Choice(
                            index=i * n + index,
                            text=prefix + text,
                            logprobs=_logprobs(tok, entries, prompt_chars + was.chars),
                            finish_reason=co.finish_reason,
                        )
                    )
                    sent[index] = _Sent(was.chars + len(text), len(co.token_ids), bool(co.finish_reason))
                if choices:
                    yield _event(CompletionChunk(**head, choices=choices).model_dump_json())
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _event(CompletionChunk(**head, choices=[], usage=_usage(stats)).model_dump_json())
        yield _event("[DONE]")
        done = True
    except RuntimeError as exc:  # the engine loop died mid-stream: the status is sent, say it in-band
        stats.error, done = "engine_failed", True
        yield _event(json.dumps(error_body(500, str(exc), "engine_failed")))
    finally:
        if not done:  # the client went away (or the engine failed): free the engine's work
            stats.disconnected = True
            for job in jobs:
                job.stream.cancel()
