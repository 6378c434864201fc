"""Structured outputs: a request's grammar (a JSON schema, any JSON object, a regex, a choice
of strings, a Lark or GBNF grammar), compiled by llguidance once per distinct spec, and the
per-sequence matcher whose token mask the sampler applies.

Compiling is the costly part (a nested schema takes tens of milliseconds, a pathological one
seconds), so `GrammarCompiler` keeps the compiled matchers in a bounded LRU cache and
compiles on its own threads within a time limit: a spec over it is a `GrammarTimeoutError`
in the caller's thread (the service's 400), never a stalled engine step. Each sequence then
takes a copy of the compiled matcher (microseconds) and advances it token by token; a mask
costs tens of microseconds (benchmarks/structured.py measures it).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import jsonschema
import llguidance
import torch
from tokenizers import Tokenizer

COMPILE_THREADS = 2  # compiles run beside the engine, never more than this many at once


class GrammarError(ValueError):
    """The spec is not one llguidance can enforce: an invalid schema, regex or grammar, or an
    unsupported keyword. The message says what, for the request's author."""


class GrammarTimeoutError(GrammarError):
    """The spec took longer to compile than the engine allows."""


@dataclass(frozen=True)
class StructuredOutputs:
    """vLLM's StructuredOutputsParams: exactly one of `json` (a JSON schema, kept as its
    compact text: equal schemas share a cache entry; key order is kept, as it orders the output), `json_object` (any JSON object),
    `regex`, `choice` (one of these strings) or `grammar` (Lark or GBNF). `whitespace_pattern`
    (JSON only) is the regex of whitespace allowed between tokens; by default none, so the
    output is compact JSON and a small model cannot spin in whitespace."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise GrammarError(
                f"give exactly one of json, json_object, regex, choice or grammar, got {given or 'none'}"
            )
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json, separators=(",", ":")))
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise GrammarError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.whitespace_pattern is not None and self.json is None and not self.json_object:
            raise GrammarError("whitespace_pattern applies to json and json_object only")

    @property
    def kind(self) -> str:
        """What constrains the output: json, json_object, regex, choice or grammar (a metric label)."""
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k))

    def to_llguidance(self) -> str:
        """The spec as an llguidance grammar (not yet checked)."""
        if self.json is not None or self.json_object:
            schema = self.json if self.json is not None else '{"type":"object"}'
            if self.json is not None:
                _check_schema(self.json)
            ws = {"whitespace_flexible": False}
            if self.whitespace_pattern is not None:
                ws = {"whitespace_flexible": True, "whitespace_pattern": self.whitespace_pattern}
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=ws)
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return llguidance.grammar_from("choice", list(self.choice))
        return llguidance.grammar_from("grammar", self.grammar)


def _check_schema(text: str) -> None:
    """A JSON schema valid under its metaschema ($schema's draft, else 2020-12)."""
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise GrammarError(f"the JSON schema is not JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(map(str, exc.path))
        raise GrammarError(
            f"not a valid JSON schema{f' at {where}' if where else ''}: {exc.message}"
        ) from None


class GrammarCompiler:
    """Compiled matchers per distinct spec (an LRU of `cache_size`), each compiled once on
    the compile threads within `timeout` seconds; `matcher(spec)` hands out fresh copies.
    Thread-safe: request threads compile while the engine thread fills masks."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        cache_size: int,
        timeout: float,
    ):
        eos = sorted(eos_token_ids) or None
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.to_str(), n_vocab=max(vocab_size, tokenizer.get_vocab_size()), eos_token=eos
        )
        self.vocab_size, self.cache_size, self.timeout = vocab_size, cache_size, timeout
        self._cache: OrderedDict[StructuredOutputs, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="lmops-grammar")
        self._executor = llguidance.LLExecutor()

    def matcher(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """A matcher at the start of `spec`'s grammar; GrammarError when it cannot be had."""
        with self._lock:
            future = self._cache.get(spec)
            if future is None:
                future = self._cache[spec] = self._pool.submit(self._compile, spec)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(spec)
        try:
            compiled = future.result(self.timeout)
        except FutureTimeout:
            raise GrammarTimeoutError(
                f"the {spec.kind} grammar took longer than {self.timeout:g} s to compile; simplify it"
            ) from None
        return compiled.deep_copy()

    def _compile(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        try:
            grammar = spec.to_llguidance()
        except GrammarError:
            raise
        except ValueError as exc:  # llguidance's, for a spec it cannot read
            raise GrammarError(str(exc)) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise GrammarError(messages[0].strip())
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error().strip())
        return matcher

    def fill_masks(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """Each matcher's allowed next tokens as an (R, ceil(vocab / 32)) int32 bitmask,
        computed in parallel without the GIL."""
        words = (self.tokenizer.vocab_size + 31) // 32
        bitmask = torch.empty(len(matchers), words, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), words * 4, len(matchers)
        )
        return bitmask
