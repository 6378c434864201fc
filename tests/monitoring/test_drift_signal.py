"""The drift signal separates the model's own kind of text from other kinds (a trained model)."""

from __future__ import annotations

import statistics

import pytest

from lmops.runtime.engine import LLMEngine, SamplingParams
from tests.monitoring.drift_prompts import in_distribution, out_of_distribution


def median_bpb(engine: LLMEngine, prompts: list) -> float:
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
    return statistics.median(o.metrics.prompt_bits_per_byte for o in outs)


def test_held_out_text_scores_near_the_reference_and_other_text_clearly_higher(trained_model):
    engine = LLMEngine.from_pretrained(trained_model.path, device="cpu", drift_sample=1.0)
    ref = trained_model.reference_bits_per_byte
    assert median_bpb(engine, in_distribution(trained_model.test_text)) == pytest.approx(ref, rel=0.2)
    for kind, prompts in out_of_distribution(trained_model.test_text, engine.tokenizer).items():
        assert median_bpb(engine, prompts) > 1.5 * ref, kind
