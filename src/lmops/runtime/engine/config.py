"""`EngineConfig`: every engine setting and its default, in one place.

The CLI, the evaluate stage, the pyfunc, the service and the benchmarks all build their
engine from this one dataclass (the service reads it from the environment), so a default
changes here and nowhere else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

QUANTIZATION_METHODS = ("int8",)  # lmops.runtime.quantize implements them


def check_quantization(method: str | None) -> None:
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)} or None, got {method!r}")


def positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def compile_default() -> bool:
    """On unless LMOPS_COMPILE is false: the one switch for the CLI, service, benchmarks
    and tests (tests/conftest.py turns it off; compiling costs seconds per engine)."""
    value = os.environ.get("LMOPS_COMPILE", "").strip().lower() or "1"  # empty = unset
    if value not in _BOOLS:
        raise ValueError(f"LMOPS_COMPILE must be one of {sorted(_BOOLS)}, got {value!r}")
    return _BOOLS[value]


_BOOLS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


@dataclass(frozen=True)
class EngineConfig:
    device: str = "auto"  # "auto" = CUDA when present, else CPU
    dtype: str = "auto"  # "auto" = bfloat16 on CUDA, float32 on CPU
    block_size: int = 16  # tokens per KV-cache page (the model's context is `max_seq_len`)
    kv_cache_memory: int | None = None  # bytes; None = sized from max_num_seqs and free memory
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    # Compiled decode steps on CPU (engine/compiled.py); compiles at engine start.
    compile: bool = field(default_factory=compile_default)
    # Fraction of requests whose prompt the engine also scores in bits/byte (the drift signal,
    # `lmops:prompt_bits_per_byte`); 0 disables it.
    drift_sample: float = 0.1
    quantization: str | None = None  # "int8": weight-only int8 linears and LM head (lmops.runtime.quantize)
    # Structured outputs (engine/grammar.py): compiled grammars kept, and the seconds one may
    # take to compile before its request is refused.
    grammar_cache_size: int = 64
    grammar_compile_timeout: float = 5.0
    # Speculative decoding of plain greedy requests: up to this many tokens a step proposed by
    # prompt lookup (n-gram matches in the sequence's own tokens) and verified in the same
    # forward; the output is greedy's own. 0 disables it.
    num_speculative_tokens: int = 0

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "grammar_cache_size"):
            positive_int(name, getattr(self, name))
        if isinstance(self.drift_sample, bool) or not isinstance(self.drift_sample, int | float):
            raise ValueError(f"drift_sample must be a number in [0, 1], got {self.drift_sample!r}")
        if not 0 <= self.drift_sample <= 1:
            raise ValueError(f"drift_sample must be in [0, 1], got {self.drift_sample!r}")
        n = self.num_speculative_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"num_speculative_tokens must be an integer >= 0, got {n!r}")
        check_quantization(self.quantization)
        timeout = self.grammar_compile_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be a number of seconds > 0, got {timeout!r}")
