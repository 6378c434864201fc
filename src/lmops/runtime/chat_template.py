"""Chat messages to a prompt, as transformers' `apply_chat_template` renders them: the
model directory's Jinja template (model_dir.read_chat_template) in jinja2's immutable
sandbox with transformers' settings (trim_blocks, lstrip_blocks, loopcontrols) and globals
(raise_exception, strftime_now, a tojson that does not escape HTML), given `messages`,
`add_generation_prompt` and the tokenizer's special tokens. Parity with transformers is a
test (tests/unit/test_chat_template.py); this keeps transformers out of the serving image.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template failed on these messages (its raise_exception, or a rendering error)."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached: a server renders one template for every request)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template does not parse: {exc}") from None


def render(
    source: str,
    messages: list[dict],
    special_tokens: dict[str, str],
    add_generation_prompt: bool,
    tools: list[dict] | None = None,
) -> str:
    """The prompt text for `messages` ({"role", "content"} dicts), with OpenAI-shaped `tools`
    given to the template as transformers gives them (only when there are some)."""
    extra = {"tools": tools} if tools else {}
    try:
        return compile_template(source).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens, **extra
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from None
