"""`EngineConfig`: every engine setting and its default, in one place.

The CLI, the evaluate stage, the pyfunc, the service and the benchmarks all build their
engine from this one dataclass (the service reads it from the environment), so a default
changes here and nowhere else.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields

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


SCHEDULING_POLICIES = ("fcfs", "priority")
# A request's priority is a 64-bit signed integer (lower runs first, as in vLLM).
PRIORITY_BOUND = 2**63


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `KVEventsConfig`, key for key: the engine publishes its KV-cache events
    (engine/kv_events.py) as vLLM does, so llm-d's precise prefix-cache scorer reads them."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" when enabled, else "null"
    # vLLM's rule: an endpoint with "*", "::", ipc:// or inproc:// is bound, any other connected to.
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # a ROUTER socket, always bound; None: no replay
    buffer_steps: int = 10_000  # batches (one per engine step) kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    # vLLM bounds its hand-off queue with it; lmops sends on the engine's thread, so
    # nothing queues (the PUB socket's hwm bounds what waits). Accepted, checked.
    max_queue_size: int = 100_000
    topic: str = ""  # llm-d reads "kv@<pod>@<model>"

    def __post_init__(self):
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(
                f"enable_kv_cache_events must be true or false, got {self.enable_kv_cache_events!r}"
            )
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError(f"replay_endpoint must be a string or null, got {self.replay_endpoint!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            positive_int(name, getattr(self, name))

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: str | dict) -> KVEventsConfig:
        """From LMOPS_KV_EVENTS_CONFIG's JSON text (or its dict); a wrong key or value is
        one ValueError naming it."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"kv_events_config is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {value!r}")
        keys = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(keys))
        if unknown:
            raise ValueError(f"kv_events_config has an unknown key {unknown[0]!r}; vLLM's keys are {keys}")
        try:
            return cls(**value)
        except ValueError as exc:
            raise ValueError(f"kv_events_config is invalid: {exc}") from None


@dataclass(frozen=True)
class EngineConfig:
    device: str = "auto"  # "auto" = CUDA when present, else CPU
    dtype: str = "auto"  # "auto" = bfloat16 on CUDA, float32 on CPU
    block_size: int = 16  # tokens per KV-cache page (the model's context is `max_seq_len`)
    kv_cache_memory: int | None = None  # bytes; None = sized from max_num_seqs and free memory
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    # Compiled decode steps and a lone fresh prompt's prefill on CPU (engine/compiled.py);
    # compiles at engine start (loaded from the compile cache after the first time).
    compile: bool = field(default_factory=compile_default)
    # Fraction of requests whose prompt the engine also scores in bits/byte (the drift signal,
    # `lmops:prompt_bits_per_byte`); 0 disables it.
    drift_sample: float = 0.1
    quantization: str | None = None  # "int8": weight-only int8 linears and LM head (lmops.runtime.quantize)
    # Structured outputs (engine/grammar.py): compiled grammars kept, and the seconds one may
    # take to compile before its request is refused.
    grammar_cache_size: int = 64
    grammar_compile_timeout: float = 5.0
    # Speculative decoding: up to this many tokens a step proposed by prompt lookup (n-gram
    # matches in the sequence's own tokens) and verified in the same forward; greedy output
    # is greedy's own, sampled output keeps its distribution (rejection sampling). With
    # multi-step decoding a lone greedy request drafts and verifies inside its compiled run
    # (up to num_scheduler_steps passes of 1 + this many tokens a graph call). 0 disables it.
    num_speculative_tokens: int = 0
    # A draft model directory (config.json, model.safetensors, and the target's own
    # tokenizer.json) whose greedy tokens are the drafts instead of prompt lookup's; None:
    # prompt lookup. Needs num_speculative_tokens >= 1. On a CPU it is a loss (it runs
    # eagerly: benchmarks/README.md, "Single stream"), and the engine warns at load.
    speculative_model: str | None = None
    # Multi-step decoding (vLLM's num_scheduler_steps): a lone request, greedy or sampled with
    # temperature and the filters alone (`SamplingParams.graph_draw`), runs up to this many
    # decode steps in one compiled graph call, so the Python step around the graph is paid
    # once for them (its tokens stream in runs of up to this many, and a newcomer waits for
    # the run: a few ms). On by default, unlike vLLM: on CPU it is what brings one stream level
    # with CTranslate2 (benchmarks/README.md, "Single stream"). CPU with `compile` only; 1: off.
    num_scheduler_steps: int = 8
    # vLLM's: "fcfs" serves requests in arrival order; "priority" serves the lowest
    # `priority` first (ties by arrival) and preempts the highest when blocks run out.
    scheduling_policy: str = "fcfs"
    # KV-cache events for llm-d (vLLM's KVEventsConfig; JSON text in LMOPS_KV_EVENTS_CONFIG). Off: None.
    kv_events_config: KVEventsConfig | str | dict | None = None

    def __post_init__(self):
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "grammar_cache_size",
            "num_scheduler_steps",
        ):
            positive_int(name, getattr(self, name))
        if isinstance(self.drift_sample, bool) or not isinstance(self.drift_sample, int | float):
            raise ValueError(f"drift_sample must be a number in [0, 1], got {self.drift_sample!r}")
        if not 0 <= self.drift_sample <= 1:
            raise ValueError(f"drift_sample must be in [0, 1], got {self.drift_sample!r}")
        n = self.num_speculative_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"num_speculative_tokens must be an integer >= 0, got {n!r}")
        if self.speculative_model is not None:
            if not isinstance(self.speculative_model, str) or not self.speculative_model:
                raise ValueError(
                    f"speculative_model must be a model directory or None, got {self.speculative_model!r}"
                )
            if n == 0:
                raise ValueError("speculative_model drafts num_speculative_tokens tokens a step: set it >= 1")
        check_quantization(self.quantization)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {list(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        if isinstance(self.kv_events_config, str | dict):
            object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        elif self.kv_events_config is not None and not isinstance(self.kv_events_config, KVEventsConfig):
            raise ValueError(
                f"kv_events_config must be a KVEventsConfig or JSON, got {self.kv_events_config!r}"
            )
        timeout = self.grammar_compile_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be a number of seconds > 0, got {timeout!r}")
