"""The latency gate: candidate against champion on one workload, alternating."""

from __future__ import annotations

import math

import pytest

from lmops.pipeline.latency import MAX_TOKENS, PROMPTS, _round, _Samples, check_ratio, compare
from lmops.runtime.engine import LLMEngine
from tests.conftest import make_tiny_model_dir
from tests.slow_candidate import slow_down

STATS = ("ttft_p50", "ttft_p95", "itl_p50", "itl_p95", "tokens_per_s")


def engine(directory) -> LLMEngine:
    return LLMEngine.from_pretrained(directory, device="cpu", compile=False)


def test_a_model_against_itself_gets_every_statistic(tmp_path):
    d = make_tiny_model_dir(tmp_path / "model")
    result = compare(engine(d), engine(d))
    assert result["rounds"] == 3
    for side in ("candidate", "champion"):
        assert set(result[side]) == set(STATS)
        assert all(math.isfinite(v) and v > 0 for v in result[side].values())
    assert set(result["ratios"]) == set(STATS)
    assert all(math.isfinite(v) and v > 0 for v in result["ratios"].values())
    # No bound on the ratio itself: a model against itself measured 3.2x on a loaded 2-core
    # machine. Its orientation is test_a_slower_candidate_is_refused_only_when_a_limit_is_set's.
    assert result["ratio"] == result["ratios"]["tokens_per_s"]
    assert result["ratio"] == result["champion"]["tokens_per_s"] / result["candidate"]["tokens_per_s"]


def test_a_slower_candidate_is_refused_only_when_a_limit_is_set(tmp_path):
    """The candidate is the champion's own model, slowed by sleep (tests/slow_candidate.py)."""
    d = make_tiny_model_dir(tmp_path / "model")
    champion, candidate = engine(d), slow_down(engine(d))
    result = compare(candidate, champion, rounds=2)
    assert result["ratio"] > 1.5
    assert result["ratios"]["itl_p50"] > 1.5 and result["ratios"]["ttft_p50"] > 1.5
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
