"""The gate's paired comparison: noise is not progress, a real gain is, and the interval
is the same for the same seed."""

import numpy as np
import pytest

from lmops.errors import LmopsError
from lmops.pipeline import gate
from lmops.pipeline.params import PromoteConfig

CFG = PromoteConfig()


def units(bits_per_byte: np.ndarray, size: np.ndarray) -> list[dict]:
    return [
        {"unit": i, "offset": 0, "tokens": int(b // 3), "bytes": int(b), "nll_bits": float(r * b)}
        for i, (r, b) in enumerate(zip(bits_per_byte, size, strict=True))
    ]


@pytest.fixture(scope="module")
def champion_units():
    rng = np.random.default_rng(0)
    return rng.uniform(1.2, 2.6, 400), rng.integers(2000, 6000, 400)  # hard and easy units


def compare(candidate, champion, seed=CFG.seed):
    return gate.paired_bootstrap(candidate, champion, CFG.bootstrap_samples, CFG.confidence, seed)


def test_the_same_model_is_not_promoted(champion_units):
    rates, size = champion_units
    same = compare(units(rates, size), units(rates, size))
    assert same.delta_bits_per_byte == 0 and same.interval == (0.0, 0.0)
    assert gate.better(same, CFG)[0] is False


def test_noise_between_units_is_not_progress(champion_units):
    """A retrain that is better on some units and worse on others by chance (mean 0)."""
    rates, size = champion_units
    noisy = rates + np.random.default_rng(1).normal(0, 0.05, len(rates))
    result = compare(units(noisy, size), units(rates, size))
    low, high = result.interval
    assert low < result.delta_bits_per_byte < high and high > -CFG.min_improvement
    ok, reason = gate.better(result, CFG)
    assert not ok and "not all below -0.02" in reason and "400 units" in reason


def test_a_real_gain_is_promoted_with_its_interval(champion_units):
    rates, size = champion_units
    better = rates - 0.08 + np.random.default_rng(2).normal(0, 0.05, len(rates))
    result = compare(units(better, size), units(rates, size))
    assert result.delta_bits_per_byte == pytest.approx(-0.08, abs=0.01)
    assert result.interval[0] < result.delta_bits_per_byte < result.interval[1] < -CFG.min_improvement
    ok, reason = gate.better(result, CFG)
    assert ok and reason.endswith("below -0.02")
    # A gain inside the margin is not enough, however sure.
    small = compare(units(rates - 0.01, size), units(rates, size))
    assert small.interval[1] < 0 and not gate.better(small, CFG)[0]


def test_seeded_and_sized_in_bounded_memory(champion_units, monkeypatch):
    rates, size = champion_units
    noisy = units(rates + np.random.default_rng(3).normal(0, 0.05, len(rates)), size)
    first = compare(noisy, units(rates, size))
    assert compare(noisy, units(rates, size)) == first
    assert compare(noisy, units(rates, size), seed=7).interval != first.interval
    monkeypatch.setattr(gate, "DRAW_CELLS", 1000)  # many small draws give the same numbers
    assert compare(noisy, units(rates, size)).interval == pytest.approx(first.interval)


def test_units_must_match(champion_units):
    rates, size = champion_units
    with pytest.raises(LmopsError, match="different test units"):
        compare(units(rates, size), units(rates[:-1], size[:-1]))
