"""A request's output constraint: OpenAI's `response_format` or vLLM's `structured_outputs`
as the engine's `StructuredOutputs`, and vLLM's removed `guided_*` fields answered with
their replacement. Invalid specs are 400s naming the field (the engine compiles them)."""

from __future__ import annotations

from lmops.runtime.engine.grammar import GrammarError, GrammarTimeoutError, StructuredOutputs
from production_service import tools
from production_service.errors import APIError

# vLLM's old fields and where each went (vLLM 0.11 removed them too).
GUIDED = {
    "guided_json": "structured_outputs.json",
    "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar",
    "guided_whitespace_pattern": "structured_outputs.whitespace_pattern",
    "guided_decoding_backend": "nothing (lmops always uses llguidance)",
}


def reject_guided(body: object) -> None:
    """A `guided_*` field is a 400 naming what replaces it, not "unknown field"."""
    for name in body if isinstance(body, dict) else ():
        if name in GUIDED:
            raise APIError(
                400,
                f"{name}: no longer supported; use {GUIDED[name]}"
                + (" or response_format" if name == "guided_json" else ""),
                code="invalid_value",
                param=name,
            )


def _field(body, constraint: StructuredOutputs | None) -> tuple[str, str]:
    """(the top-level field, the path a message names) that sets the request's constraint."""
    if getattr(body, "structured_outputs", None) is not None:
        return "structured_outputs", "structured_outputs" + (f".{constraint.kind}" if constraint else "")
    if getattr(body, "response_format", None) is None:
        return "tools", "tools"
    if body.response_format.type == "json_schema":
        return "response_format", "response_format.json_schema.schema"
    return "response_format", "response_format"


def spec(body) -> StructuredOutputs | None:
    """The engine's constraint for `body`: its response_format or structured_outputs."""
    fmt, so = getattr(body, "response_format", None), getattr(body, "structured_outputs", None)
    constrained = fmt is not None and fmt.type != "text"
    calls = tools.constraint(body) if hasattr(body, "tools") else None
    if constrained + (so is not None) + (calls is not None) > 1:
        raise APIError(
            400,
            "response_format: give one of response_format, structured_outputs or tools (with a tool_choice but none)",
            code="invalid_value",
            param="response_format",
        )
    if calls is not None:
        return calls
    try:
        if so is not None:
            return StructuredOutputs(**so.model_dump(exclude_none=True, by_alias=True))
        if fmt is not None and fmt.type == "json_object":
            return StructuredOutputs(json_object=True)
        if fmt is not None and fmt.type == "json_schema":
            return StructuredOutputs(json=fmt.json_schema.schema_)
    except GrammarError as exc:
        raise invalid(body, exc) from None
    return None


def invalid(body, exc: GrammarError, constraint: StructuredOutputs | None = None) -> APIError:
    """The 400 for a spec the engine cannot enforce (`constraint`, once it was made)."""
    field, path = _field(body, constraint)
    code = "grammar_compile_timeout" if isinstance(exc, GrammarTimeoutError) else "invalid_value"
    return APIError(400, f"{path}: {exc}", code=code, param=field)
