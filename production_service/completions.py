"""From a validated request to engine requests, and from their outputs to the API's
objects, one JSON body or server-sent events: the waiting, streaming and usage shared by
/v1/completions (`TextFormat`, here) and /v1/chat/completions (chat.py)."""

from __future__ import annotations

import dataclasses
import json
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel

from lmops.runtime.engine import (
    CompletionOutput,
    PromptTooLongError,
    QueueFullError,
    RequestOutput,
    SamplingParams,
)
from lmops.runtime.engine.grammar import GrammarError
from production_service import structured
from production_service.errors import APIError, error_body
from production_service.model_source import CHAMPION
from production_service.observability import RequestStats
from production_service.schemas import (
    MAX_PROMPTS,
    Choice,
    Completion,
    CompletionChunk,
    Limits,
    Logprobs,
    PromptLogprob,
    Usage,
)

# How often a non-streaming request looks whether its client is still there.
DISCONNECT_POLL_S = 0.5
# The SamplingParams fields a request sets under their own names; the request models
# spell the others their own way: logprobs and prompt_logprobs (`sampling_fields()`: chat's
# boolean logprobs, echo's prompt log-probs), logit_bias with string keys, structured_outputs
# (with response_format: structured.py).
_SPELLED_OWN_WAY = {"logprobs", "prompt_logprobs", "logit_bias", "structured_outputs"}
_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name not in _SPELLED_OWN_WAY)


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
    messages = body.get("messages")
    if isinstance(messages, list):
        chars = sum(_chars(m.get("content")) for m in messages if isinstance(m, dict))
        if chars > limits.max_prompt_chars:
            raise _too_long(f"the messages have {chars} characters, so more tokens than fit", limits)
    for p in prompt if isinstance(prompt, list) else [prompt]:
        if isinstance(p, list) and len(p) > limits.max_prompt_tokens:
            raise _too_long(f"a prompt has {len(p)} token ids", limits)
        if isinstance(p, str) and len(p) > limits.max_prompt_chars and not truncate:
            raise _too_long(f"a prompt has {len(p)} characters, so more tokens than fit", limits)


def _chars(content: object) -> int:
    """Characters of a chat message's content: a string, or text parts."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def _too_long(what: str, limits: Limits) -> APIError:
    return APIError(
        400,
        f"{what}; this model's context is {limits.max_model_len} tokens, so a prompt may have at "
        f"most {limits.max_prompt_tokens}; shorten it or set truncate_prompt_tokens.",
        code="context_length_exceeded",
        param="prompt",
    )


def encode_prompts(served, body) -> list[tuple[str, list[int]]]:
    """(text, token ids) per prompt, tokenized as the engine does, left-truncated only
    when `truncate_prompt_tokens` asks for it. A text to truncate is tokenized from a
    tail twice as long as any prompt can be, so a huge one costs no more than a long one."""
    tokenizer, limits, prompt = served.engine.tokenizer, served.limits, body.prompt
    truncate = getattr(body, "truncate_prompt_tokens", None)
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


def sampling_params(body, defaults: SamplingParams) -> SamplingParams:
    """What the request sets, on top of the model's sampling defaults (its
    generation_config.json and LMOPS_GENERATION_CONFIG, merged once at load). The engine
    caps max_tokens at the room the context leaves after the prompt."""
    kwargs = {k: getattr(body, k) for k in _SAMPLING_FIELDS if getattr(body, k, None) is not None}
    kwargs.update((k, v) for k, v in body.sampling_fields().items() if v is not None)
    if getattr(body, "logit_bias", None):
        kwargs["logit_bias"] = {int(t): b for t, b in body.logit_bias.items()}
    if (constraint := structured.spec(body)) is not None:
        kwargs["structured_outputs"] = constraint
    try:
        return dataclasses.replace(defaults, **kwargs)
    except ValueError as exc:
        param = next((f for f in _SAMPLING_FIELDS if str(exc).startswith(f"{f} ")), None)
        raise APIError(400, str(exc), code="invalid_value", param=param) from None


def queue_full() -> APIError:
    return APIError(
        429, "The server's queue is full; retry shortly.", code="queue_full", headers={"Retry-After": "1"}
    )


def submit(runtime, served, body, stats: RequestStats, prompts: list[tuple[str, list[int]]]) -> list[Job]:
    """Submit every (text, token ids) prompt to the pinned model `served`, or none: a failure
    cancels what was already submitted. A champion prompt the shadow picks is scored and
    mirrored to the challenger."""
    params = sampling_params(body, served.sampling_defaults)
    priority = getattr(body, "priority", None) or 0
    shadow = runtime.shadow if served.role == CHAMPION else None
    jobs: list[Job] = []
    try:
        for text, ids in prompts:
            mirrored = shadow is not None and shadow.pick()
            jobs.append(Job(text, served.loop.submit(ids, params, priority=priority, score_prompt=mirrored)))
            stats.prompt_tokens += len(ids)
            if mirrored:
                shadow.mirror(jobs[-1])
    except QueueFullError:
        raise queue_full() from None
    except PromptTooLongError as exc:
        chat = hasattr(body, "messages")
        raise APIError(
            400,
            f"{exc}; shorten {'the messages' if chat else 'it or set truncate_prompt_tokens'}.",
            code="context_length_exceeded",
            param="messages" if chat else "prompt",
        ) from None
    except GrammarError as exc:
        raise structured.invalid(body, exc, params.structured_outputs) from None
    except ValueError as exc:
        param = next((f for f in ("n", "priority") if str(exc).startswith(f"{f} ")), "prompt")
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


def usage(stats: RequestStats) -> Usage:
    return Usage(
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=stats.completion_tokens,
        total_tokens=stats.prompt_tokens + stats.completion_tokens,
    )


@dataclass
class Piece:
    """What one choice adds to the answer: all of it (a plain answer), or what is new
    since its last event (a stream). `entries` are the new tokens' log-prob entries."""

    index: int
    job: Job
    out: RequestOutput
    co: CompletionOutput
    text: str
    entries: list[dict] | None
    first: bool  # nothing of this choice was sent before
    chars: int  # characters of this choice's text sent before


class Format(Protocol):
    """One API's shapes over the shared waiting and streaming (legacy completions here,
    chat in chat.py): a choice from a piece, and the body or event around the choices."""

    def choice(self, piece: Piece, stream: bool) -> BaseModel: ...

    def body(self, choices: list, usage: Usage | None, stream: bool) -> BaseModel: ...

    def opens(self, piece: Piece) -> bool:
        """Whether a choice's first event is sent before it has text (echo, chat's role)."""
        ...


class TextFormat:
    """OpenAI's legacy completions: text, `echo` (the prompt first, with its log-probs
    when `logprobs` is set: the first token's null), vLLM's `prompt_logprobs`."""

    def __init__(self, served, body, completion_id: str):
        self.tok, self.echo = served.engine.tokenizer, bool(getattr(body, "echo", False))
        self.prompt_logprobs = getattr(body, "prompt_logprobs", None) is not None
        self.head = {"id": completion_id, "created": int(time.time()), "model": served.id}

    def opens(self, piece: Piece) -> bool:
        return self.echo

    def choice(self, piece: Piece, stream: bool) -> Choice:
        prefix, entries, offset = "", piece.entries, piece.chars
        if self.echo:
            offset += len(piece.job.prompt_text)
            if piece.first:
                prefix, offset = piece.job.prompt_text, 0
                if entries is not None:
                    entries = prompt_entries(piece.out) + entries
        return Choice(
            index=piece.index,
            text=prefix + piece.text,
            logprobs=_legacy_logprobs(self.tok, entries, offset),
            finish_reason=piece.co.finish_reason,
            prompt_logprobs=vllm_prompt_logprobs(self.tok, piece.out)
            if self.prompt_logprobs and piece.first
            else None,
        )

    def body(self, choices: list, usage: Usage | None, stream: bool):
        return (CompletionChunk if stream else Completion)(**self.head, choices=choices, usage=usage)


def prompt_entries(out: RequestOutput) -> list[dict]:
    """The prompt's tokens as log-prob entries; nothing predicts the first, so it has none."""
    first = {"token_id": out.prompt_token_ids[0], "logprob": None, "top": None}
    return [first, *out.prompt_logprobs[1:]]


def vllm_prompt_logprobs(tok, out: RequestOutput) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: logprob, rank, decoded_token}
    for the token itself and its top alternatives; None for the first."""
    result: list[dict[str, PromptLogprob] | None] = [None]
    for e in out.prompt_logprobs[1:]:
        ranked = {e["token_id"]: (e["logprob"], e["rank"])}
        for rank, (t, lp) in enumerate(e["top"].items(), 1):
            ranked.setdefault(int(t), (lp, rank))
        result.append(
            {
                str(t): PromptLogprob(logprob=_logprob(lp), rank=rank, decoded_token=tok.decode([t]))
                for t, (lp, rank) in ranked.items()
            }
        )
    return result


def _legacy_logprobs(tok, entries: list[dict] | None, offset: int) -> Logprobs | None:
    """Per-token log-prob entries in OpenAI's legacy completions shape."""
    if entries is None:
        return None
    tokens = [tok.decode([e["token_id"]]) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return Logprobs(
        tokens=tokens,
        token_logprobs=[None if e["logprob"] is None else _logprob(e["logprob"]) for e in entries],
        top_logprobs=[
            None if e["top"] is None else {tok.decode([int(t)]): _logprob(lp) for t, lp in e["top"].items()}
            for e in entries
        ],
        text_offset=offsets,
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
    fmt: Format, jobs: list[Job], stats: RequestStats, client_gone: Callable[[], bool], n: int = 1
) -> BaseModel:
    """Wait for every job (of `n` choices each); a client that goes away aborts them
    all, as a stream's does."""
    choices = []
    done = False
    try:
        for i, job in enumerate(jobs):
            final: dict[int, CompletionOutput] = {}
            last = None
            for last in _outputs(job.stream, client_gone):
                for co in last.outputs:
                    final[co.index] = co
                    stats.on_tokens(len(co.delta_token_ids))
            choices += [
                fmt.choice(
                    Piece(i * n + co.index, job, last, co, co.text, co.logprobs, True, 0), stream=False
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
    return fmt.body(choices, usage(stats), stream=False)


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


def stream_events(fmt: Format, jobs: list[Job], body, stats: RequestStats) -> Iterator[str]:
    """Server-sent events, one per batch of new text (with `stream_options`: usage at the
    end, and in every event with `continuous_usage_stats`); a client that goes away (the
    server closes this generator) aborts every job and frees its KV blocks."""
    n, options = body.n or 1, body.stream_options
    continuous = options is not None and options.continuous_usage_stats
    done = False
    try:
        for i, job in enumerate(jobs):
            sent: dict[int, _Sent] = {}
            while (out := job.stream.get()) is not None:
                choices = []
                outs = _drain(job.stream, out)
                for index, (text, ids, co) in _merge(outs).items():
                    stats.on_tokens(len(ids))
                    was = sent.get(index)
                    piece = Piece(
                        i * n + index,
                        job,
                        outs[-1],
                        co,
                        text,
                        None if co.logprobs is None else co.logprobs[was.tokens if was else 0 :],
                        was is None,
                        was.chars if was else 0,
                    )
                    if (was and was.finished) or not (
                        text or co.finish_reason or (was is None and fmt.opens(piece))
                    ):
                        continue  # nothing to say (yet): text held back for a stop string or a partial character
                    choices.append(fmt.choice(piece, stream=True))
                    was = was or _Sent()
                    sent[index] = _Sent(was.chars + len(text), len(co.token_ids), bool(co.finish_reason))
                if choices:
                    yield _event(
                        fmt.body(choices, usage(stats) if continuous else None, stream=True).model_dump_json()
                    )
        if options is not None and options.include_usage:
            yield _event(fmt.body([], usage(stats), stream=True).model_dump_json())
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
