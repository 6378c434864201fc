"""OpenAI's `tools` and `tool_choice` on /v1/chat/completions.

A call is written `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes' syntax,
which many chat templates use). With `required` or a named function the output is one or
more such calls (one, for a named function or with `parallel_tool_calls: false`), each constrained to its function's parameter
schema; with `auto` the grammar admits either text (not starting with "<") or calls; `none`
leaves the output free. The tools reach the prompt through the chat template's `tools`;
a template that does not mention them (the pipeline's plain one) gets them as a first
system message instead, with the call syntax.
"""

from __future__ import annotations

import json
import re
import uuid

import jsonschema

from lmops.runtime.engine.grammar import StructuredOutputs
from production_service.errors import APIError
from production_service.schemas import NamedToolChoice

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALLS = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", code="invalid_value", param=param.split(".")[0].split("[")[0])


def chosen(body) -> list | None:
    """The functions the output may call (None: free text), checked: every parameters a JSON
    schema, a named tool_choice one of the tools."""
    tools, choice = body.tools or [], body.tool_choice or "auto"
    if body.tool_choice not in (None, "none") and not tools:
        raise _bad("tool_choice", "needs tools")
    for i, tool in enumerate(tools):
        try:
            jsonschema.validators.validator_for(tool.function.parameters).check_schema(
                tool.function.parameters
            )
        except jsonschema.SchemaError as exc:
            raise _bad(f"tools[{i}].function.parameters", f"not a JSON schema: {exc.message}") from None
    if not tools or choice == "none":
        return None
    if not isinstance(choice, NamedToolChoice):
        return tools
    named = [t for t in tools if t.function.name == choice.function.name]
    if not named:
        names = ", ".join(repr(t.function.name) for t in tools)
        raise _bad("tool_choice", f"function {choice.function.name!r} is not in tools ({names})")
    return named


def constraint(body) -> StructuredOutputs | None:
    """The grammar of what the model may answer, given its tools and tool_choice."""
    functions = chosen(body)
    if functions is None:
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in functions
    ]
    schema = {"anyOf": calls, "x-guidance": {"whitespace_flexible": False}}
    choice = body.tool_choice or "auto" if not isinstance(body.tool_choice, NamedToolChoice) else "named"
    calls = "call" if choice == "named" or body.parallel_tool_calls is False else "call+"
    start = f"TEXT | {calls}" if choice == "auto" else calls
    return StructuredOutputs(
        grammar=f'start: {start}\ncall: "{OPEN}" body "{CLOSE}"\nbody: %json {json.dumps(schema)}\n'
        "TEXT: /[^<][^\\x00]*/\n"
    )


def rendered_tools(body, template: str) -> tuple[list[dict] | None, list[dict]]:
    """(the template's `tools`, system messages to put first): the tools as the template
    renders them, or described in a system message when it would not."""
    if not body.tools:
        return None, []
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    if "tools" in template:
        return tools, []
    text = f'Tools (call one as {OPEN}{{"name":…,"arguments":…}}{CLOSE}):\n' + "\n".join(
        json.dumps(t["function"], separators=(",", ":")) for t in tools
    )
    return None, [{"role": "system", "content": text}]


def call_text(calls: list[dict]) -> str:
    """An earlier assistant turn's tool calls in the call syntax (for templates without tools)."""
    return "".join(
        f'{OPEN}{{"name": {json.dumps(c["function"]["name"])}, "arguments": {c["function"]["arguments"]}}}{CLOSE}'
        for c in calls
    )


def parse(text: str) -> list[dict] | None:
    """The tool calls an output consists of, in OpenAI's shape; None when it is text."""
    if not text.startswith(OPEN):
        return None
    calls = []
    for body in _CALLS.findall(text):
        try:
            call = json.loads(body)
        except ValueError:
            return None
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
            }
        )
    return calls or None


def may_become_call(text: str) -> bool:
    """Whether a streamed choice's text so far may still turn out to be tool calls (then
    it is held back until the choice finishes)."""
    return text.startswith(OPEN) or OPEN.startswith(text)
