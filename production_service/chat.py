"""/v1/chat/completions: messages through the model's chat template to one prompt, and
the engine's outputs in OpenAI's chat shapes. Waiting, streaming and usage are
completions.py's (this is its `Format` for chat)."""

from __future__ import annotations

import time

from lmops.runtime.chat_template import ChatTemplateError, render
from production_service import tools
from production_service.completions import Piece, _logprob
from production_service.errors import APIError
from production_service.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
)

NO_TEMPLATE = (
    "This model has no chat template, so /v1/chat/completions cannot turn messages into a prompt: "
    "set LMOPS_CHAT_TEMPLATE to a Jinja template file, or add chat_template to the model's "
    "tokenizer_config.json (models the pipeline trains have one); /v1/completions needs none."
)


def render_messages(served, messages, add_generation_prompt: bool, body=None) -> str:
    """The prompt text the chat template makes of `messages` (and of a chat `body`'s tools);
    400 without a template or when the template rejects them."""
    template = served.chat_template
    if template is None:
        raise APIError(400, NO_TEMPLATE, code="chat_template_missing", param="messages")
    tool_list, preamble = tools.rendered_tools(body, template) if body is not None else (None, [])
    plain = preamble + [_plain(m, tool_list is not None) for m in messages]
    try:
        return render(template, plain, served.special_tokens, add_generation_prompt, tool_list)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), code="invalid_value", param="messages") from None


def _plain(m, template_has_tools: bool) -> dict:
    """A message as the template reads it; earlier tool calls in the call syntax when the
    template does not render them itself."""
    calls = [c.model_dump() for c in m.tool_calls or ()]
    text = m.text if m.content is not None or template_has_tools else tools.call_text(calls)
    out = {"role": m.role, "content": text, **({"name": m.name} if m.name else {})}
    if calls and template_has_tools:
        out["tool_calls"] = calls
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def encode_messages(served, body) -> list[tuple[str, list[int]]]:
    """The one prompt of a chat body, tokenized as transformers' apply_chat_template does
    (no special tokens added: the template writes them)."""
    text = render_messages(served, body.messages, body.add_generation_prompt, body)
    return [(text, served.engine.tokenizer.encode(text, add_special_tokens=False).ids)]


class ChatFormat:
    """OpenAI's chat shapes: a message (or deltas, the first with the role) and
    `logprobs.content` per token with its UTF-8 bytes and top alternatives."""

    def __init__(self, served, completion_id: str, body=None):
        self.tok = served.engine.tokenizer
        self.head = {"id": completion_id, "created": int(time.time()), "model": served.id}
        # With tools the output may be calls: a streamed choice holds its text back while
        # it may still become one (`held`, by index), and sends them whole when it finishes.
        self.calls = body is not None and tools.chosen(body) is not None
        self.held: dict[int, str] = {}

    def opens(self, piece: Piece) -> bool:
        return True  # the role comes first, as OpenAI's first chunk carries it

    def choice(self, piece: Piece, stream: bool):
        logprobs = (
            None if piece.entries is None else ChatLogprobs(content=[self._token(e) for e in piece.entries])
        )
        finish = piece.co.finish_reason
        if not stream:
            calls = tools.parse(piece.text) if self.calls and finish == "stop" else None
            message = (
                ChatMessage(content=None, tool_calls=calls) if calls else ChatMessage(content=piece.text)
            )
            return ChatChoice(
                index=piece.index,
                message=message,
                logprobs=logprobs,
                finish_reason="tool_calls" if calls else finish,
            )
        text, calls = piece.text, None
        if self.calls and (piece.first or piece.index in self.held):
            text = self.held.pop(piece.index, "") + text
            calls = tools.parse(text) if finish == "stop" else None
            if calls:
                text = None
            elif not finish and tools.may_become_call(text):
                self.held[piece.index], text = text, ""
        delta = ChatDelta(
            role="assistant" if piece.first else None,
            content=text,
            tool_calls=[ToolCallDelta(index=i, **c) for i, c in enumerate(calls)] if calls else None,
        )
        reason = "tool_calls" if calls else finish
        return ChatChunkChoice(index=piece.index, delta=delta, logprobs=logprobs, finish_reason=reason)

    def body(self, choices: list, usage: Usage | None, stream: bool):
        if stream:
            return ChatCompletionChunk(**self.head, choices=choices, usage=usage)
        return ChatCompletion(**self.head, choices=choices, usage=usage)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.tok.decode([int(token_id)])
        return TopLogprob(token=text, logprob=_logprob(logprob), bytes=list(text.encode()))

    def _token(self, entry: dict) -> TokenLogprob:
        top = [self._top(t, lp) for t, lp in entry["top"].items()]
        return TokenLogprob(**self._top(entry["token_id"], entry["logprob"]).model_dump(), top_logprobs=top)
