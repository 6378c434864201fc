"""schemathesis hooks for the live OpenAPI test (loaded through SCHEMATHESIS_HOOKS).

The document allows requests that keep the tiny CPU model busy for seconds
(16 prompts x n=16 x 255 tokens, long chats); valid cases are shrunk to cheap ones that stay
valid. A constraint (response_format, structured_outputs, tools) is valid only when its regex,
grammar or schema compiles (and a named tool_choice is among the tools), which no JSON
Schema can say, so a valid case gets a small one that does; a message's content is null
only beside tool calls, so it gets some. Invalid cases are left alone: they are rejected before any generation.
"""

from __future__ import annotations

import schemathesis


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def cheap(body: dict) -> dict:
    body = dict(body)
    if body.get("max_tokens") is None or _number(body["max_tokens"]):
        body["max_tokens"] = min(body.get("max_tokens") or 2, 2)
    if _number(body.get("max_completion_tokens")):
        body["max_completion_tokens"] = min(body["max_completion_tokens"], 2)
    if _number(body.get("n")):
        body["n"] = min(body["n"], 2)
    if body.keys() & {"response_format", "structured_outputs", "tools", "tool_choice"}:
        for key in ("response_format", "tools", "tool_choice", "parallel_tool_calls"):
            body.pop(key, None)
        body.pop("min_tokens", None)  # the grammar says where the output ends
        body["structured_outputs"] = {"choice": ["yes", "no"]}
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        body["prompt"] = prompt[:40]
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        body["prompt"] = [p[:40] for p in prompt[:2]]
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        body["prompt"] = prompt[:2]
    messages = body.get("messages")
    if isinstance(messages, list):
        body["messages"] = [
            {**m, "content": _short(m["content"] or "x")} if isinstance(m, dict) and "content" in m else m
            for m in messages[:4]
        ]
    return body


def _short(content):
    """A message's content cut to 40 characters: a string, or its first text parts."""
    if isinstance(content, str):
        return content[:40]
    if isinstance(content, list):
        return [
            {**p, "text": p["text"][:20]} if isinstance(p, dict) and isinstance(p.get("text"), str) else p
            for p in content[:2]
        ]
    return content


@schemathesis.hook
def map_case(context, case):
    if case.meta is not None and case.meta.generation.mode.is_positive and isinstance(case.body, dict):
        case.body = cheap(case.body)
    return case
