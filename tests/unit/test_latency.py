"""The latency gate: candidate against champion on one workload, alternating."""

from __future__ import annotations

import math

import pytest

from lmops.pipeline.latency import MAX_TOKENS, PROMPTS, _round, _Samples, check_ratio, compare
from lmops.pipeline.random_model import random_model_dir
from lmops.runtime.engine import LLMEngine
from lmops.runtime.model_config import TINY_SHAPE
from tests.conftest import make_tiny_model_dir

STATS = ("ttft_p50", "ttft_p95", "itl_p50", "itl_p95", "tokens_per_s")
TEXT = "\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400))
# Wide enough that the layers' compute, not per-step Python, is most of a step, so 4x the
# layers is structurally slower (ratio 3.1-4.0 seen on a 2-core machine at load 8).
WIDE = {**TINY_SHAPE, "n_embd": 384, "intermediate_size": 768}


def engine(directory) -> LLMEngine:
    return LLMEngine.from_pretrained(directory, device="cpu", compile=False)


def test_a_model_against_itself_is_about_as_fast(tmp_path):
    d = make_tiny_model_dir(tmp_path / "model")
    result = compare(engine(d), engine(d))
    assert result["rounds"] == 3
    for side in ("candidate", "champion"):
        assert set(result[side]) == set(STATS)
        assert all(math.isfinite(v) and v > 0 for v in result[side].values())
    assert set(result["ratios"]) == set(STATS)
    assert all(math.isfinite(v) and v > 0 for v in result["ratios"].values())
    assert result["ratio"] == result["ratios"]["tokens_per_s"]
    assert 0.5 < result["ratio"] < 2


def test_four_times_the_layers_is_refused_only_when_a_limit_is_set(tmp_path):
    fast = engine(random_model_dir(tmp_path / "fast", [TEXT], 300, 128, **WIDE))
    slow = engine(random_model_dir(tmp_path / "slow", [TEXT], 300, 128, **{**WIDE, "n_layer": 8}))
    result = compare(slow, fast, rounds=2)
    assert result["ratio"] > 1.5
    passes, why = check_ratio(result, 1.2)
    assert not passes and "exceeds max_latency_ratio 1.2" in why
    assert check_ratio(result, None)[0]


def test_a_short_context_model_serves_the_whole_workload(tmp_path):
    """Prompts are cut to half the context, so every request still gets MAX_TOKENS."""
    e = engine(make_tiny_model_dir(tmp_path / "model", max_seq_len=64))
    samples = _Samples()
    _round(e, "round", samples)
    assert samples.tokens == len(PROMPTS) * MAX_TOKENS
    assert len(samples.ttfts) == len(PROMPTS)
    assert len(samples.gaps) == len(PROMPTS) * (MAX_TOKENS - 1)


@pytest.mark.parametrize(
    ("max_ratio", "passes", "ending"),
    [
        (None, True, "; no max_latency_ratio set"),
        (1.5, True, " within max_latency_ratio 1.5"),
        (1.2, False, " exceeds max_latency_ratio 1.2"),
    ],
)
def test_check_ratio_states_the_numbers(max_ratio, passes, ending):
    result = {
        "candidate": {"tokens_per_s": 750.0},
        "champion": {"tokens_per_s": 1000.0},
        "ratios": {"ttft_p50": 1.25, "itl_p50": 1.4, "tokens_per_s": 1000 / 750},
        "ratio": 1000 / 750,
    }
    assert check_ratio(result, max_ratio) == (
        passes,
        "latency ratio 1.33 (750 vs the champion's 1000 tokens/s; TTFT p50 x1.25, "
        "inter-token p50 x1.40)" + ending,
    )
