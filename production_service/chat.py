"""/v1/chat/completions: messages through the model's chat template to one prompt, and
the engine's outputs in OpenAI's chat shapes. Waiting, streaming and usage are
completions.py's (this is its `Format` for chat)."""

from __future__ import annotations

import time

from lmops.runtime.chat_template import ChatTemplateError, render
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
    TopLogprob,
    Usage,
)

NO_TEMPLATE = (
    "This model has no chat template, so /v1/chat/completions cannot turn messages into a prompt: "
    "set LMOPS_CHAT_TEMPLATE to a Jinja template file, or add chat_template to the model's "
    "tokenizer_config.json (models the pipeline trains have one); /v1/completions needs none."
)


def render_messages(runtime, messages, add_generation_prompt: bool) -> str:
    """The prompt text the chat template makes of `messages`; 400 without a template or
    when the template rejects them."""
    if runtime.chat_template is None:
        raise APIError(400, NO_TEMPLATE, code="chat_template_missing", param="messages")
    plain = [{"role": m.role, "content": m.text, **({"name": m.name} if m.name else {})} for m in messages]
    try:
        return render(runtime.chat_template, plain, runtime.special_tokens, add_generation_prompt)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), code="invalid_value", param="messages") from None


def encode_messages(runtime, body) -> list[tuple[str, list[int]]]:
    """The one prompt of a chat body, tokenized as transformers' apply_chat_template does
    (no special tokens added: the template writes them)."""
    text = render_messages(runtime, body.messages, body.add_generation_prompt)
    return [(text, runtime.engine.tokenizer.encode(text, add_special_tokens=False).ids)]


class ChatFormat:
    """OpenAI's chat shapes: a message (or deltas, the first with the role) and
    `logprobs.content` per token with its UTF-8 bytes and top alternatives."""

    def __init__(self, runtime, completion_id: str):
        self.tok = runtime.engine.tokenizer
        self.head = {"id": completion_id, "created": int(time.time()), "model": runtime.model.name}

    def opens(self, piece: Piece) -> bool:
        return True  # the role comes first, as OpenAI's first chunk carries it

    def choice(self, piece: Piece, stream: bool):
        logprobs = (
            None if piece.entries is None else ChatLogprobs(content=[self._token(e) for e in piece.entries])
        )
        finish = piece.co.finish_reason
        if not stream:
            return ChatChoice(
                index=piece.index,
                message=ChatMessage(content=piece.text),
                logprobs=logprobs,
                finish_reason=finish,
            )
        delta = (
            ChatDelta(role="assistant", content=piece.text) if piece.first else ChatDelta(content=piece.text)
        )
        return ChatChunkChoice(index=piece.index, delta=delta, logprobs=logprobs, finish_reason=finish)

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
