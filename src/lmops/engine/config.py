"""`EngineConfig`: every engine setting and its default, in one place.

The CLI, the evaluate stage, the pyfunc, the service and the benchmarks all build their
engine from this one dataclass (the service reads it from the environment), so a default
changes here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmops.quantize import check_method


def positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class EngineConfig:
    device: str = "auto"  # "auto" = CUDA when present, else CPU
    dtype: str = "auto"  # "auto" = bfloat16 on CUDA, float32 on CPU
    block_size: int = 16  # tokens per KV-cache page (the model's context is `max_seq_len`)
    kv_cache_memory: int | None = None  # bytes; None = sized from max_num_seqs and free memory
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    # Fraction of requests whose prompt the engine also scores in bits/byte (the drift signal,
    # `lmops:prompt_bits_per_byte`); 0 disables it.
    drift_sample: float = 0.1
    quantization: str | None = None  # "int8": weight-only int8 linears and LM head (lmops.quantize)

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            positive_int(name, getattr(self, name))
        if isinstance(self.drift_sample, bool) or not isinstance(self.drift_sample, int | float):
            raise ValueError(f"drift_sample must be a number in [0, 1], got {self.drift_sample!r}")
        if not 0 <= self.drift_sample <= 1:
            raise ValueError(f"drift_sample must be in [0, 1], got {self.drift_sample!r}")
        check_method(self.quantization)
