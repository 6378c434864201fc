"""Speculative decoding with a draft model (`speculative_model`): its greedy tokens are the
drafts, its per-sequence KV cache follows the target's accepted tokens, and the output is
greedy's own whatever the draft model is."""

from __future__ import annotations

import logging

import pytest
import torch

from lmops.errors import LmopsError
from lmops.pipeline.random_model import random_model_dir
from lmops.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from lmops.runtime.engine.draft import DraftModel
from lmops.runtime.engine.kv_cache import KVPool
from lmops.runtime.model_config import TINY_SHAPE
from tests.conftest import make_tiny_model_dir
from tests.unit.engine.conftest import MAX_LEN, synthetic_corpus

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
PENALIZED = SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    """Another random model with the same tokenizer (trained on the same corpus) as
    conftest's `model_dir`: a draft model that mostly disagrees with the target."""
    d = tmp_path_factory.mktemp("draft-model")
    return random_model_dir(d, synthetic_corpus(), 512, MAX_LEN, seed=1, init_std=0.15, **TINY_SHAPE)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"max_num_batched_tokens": 24}, {"block_size": 8, "kv_cache_memory": 40}],
    ids=["batched", "chunked", "preempted"],
)
@pytest.mark.parametrize("draft", ["itself", "another"])
def test_draft_model_output_is_greedy(
    model_dir, other_model_dir, ref_model, prompts, draft, overrides, all_blocks_free, monkeypatch
):
    """Greedy output is the non-speculative one whether the draft model is the target
    itself or another random model (whose drafts are nearly all wrong), under continuous
    batching, chunked prefill and preemption; each draft is the one the draft model computes
    from scratch, and every draft cache is dropped with its sequence."""
    overrides = dict(overrides)  # shared by the draft cases
    if "kv_cache_memory" in overrides:
        overrides["kv_cache_memory"] *= KVPool.bytes_per_block(ref_model.config, 8, torch.float32)
    batch = [prompts[i] for i in (2, 5, 8, 11)]
    params = [GREEDY, PENALIZED, GREEDY, SEEDED]  # a sampled request drafts too
    plain = LLMEngine.from_pretrained(model_dir, device="cpu", **overrides)
    want = [o.token_ids for o in plain.generate(batch, params)]
    spec = LLMEngine.from_pretrained(
        model_dir,
        device="cpu",
        num_speculative_tokens=4,
        speculative_model=str(model_dir if draft == "itself" else other_model_dir),
        **overrides,
    )
    cached = spec.draft_model.propose

    def checked(seq, k):  # the draft cache, rolled back and dropped, holds what a recompute would
        draft = cached(seq, k)
        assert DraftModel(spec.draft_model.model, MAX_LEN).propose(seq, k) == draft
        return draft

    monkeypatch.setattr(spec.draft_model, "propose", checked)
    got = [o.token_ids for o in spec.generate(batch, params)]
    assert got[:3] == want[:3] and len(got[3]) == 40
    value = spec.metrics.registry.get_sample_value
    drafted = value("lmops:spec_decode_num_draft_tokens_total")
    acceptance = value("lmops:spec_decode_num_accepted_tokens_total") / drafted
    assert drafted > 40
    if draft == "another":
        assert acceptance < 0.1
    if "kv_cache_memory" in overrides:
        assert value("lmops:num_preemptions_total") > 0
    assert spec.draft_model.caches == {}
    all_blocks_free(spec)


def test_the_target_as_its_own_draft_model_is_always_right(model_dir, prompts, caplog):
    """Plain greedy requests with the target as draft model: every draft token is kept (the
    draft cache follows the accepted tokens), so a 40-token output takes 1 + 8 steps. On a
    CPU the engine says at load that a draft model is slower there than none."""
    with caplog.at_level(logging.WARNING, logger="lmops.runtime.engine.engine"):
        engine = LLMEngine.from_pretrained(
            model_dir, device="cpu", num_speculative_tokens=4, speculative_model=str(model_dir)
        )
    assert any(r.getMessage().startswith("speculative_model on CPU: ") for r in caplog.records)
    for p in (prompts[3], prompts[9]):
        engine.add_request(None, p, GREEDY)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    value = engine.metrics.registry.get_sample_value
    drafted = value("lmops:spec_decode_num_draft_tokens_total")
    assert value("lmops:spec_decode_num_accepted_tokens_total") == drafted == 2 * (4 * 7 + 3)
    assert steps == 1 + 8


def test_a_bad_draft_model_is_one_line(model_dir, tmp_path):
    other = make_tiny_model_dir(tmp_path / "other-tokenizer")  # another corpus, another vocabulary
    with pytest.raises(LmopsError, match=r"^speculative_model: .* has another tokenizer") as exc:
        LLMEngine.from_pretrained(
            model_dir, device="cpu", num_speculative_tokens=4, speculative_model=str(other)
        )
    assert "\n" not in str(exc.value)
    with pytest.raises(LmopsError, match=r"^speculative_model: .*nowhere: model directory not found$"):
        LLMEngine.from_pretrained(
            model_dir, device="cpu", num_speculative_tokens=4, speculative_model=str(tmp_path / "nowhere")
        )
    (tmp_path / "empty").mkdir()
    with pytest.raises(LmopsError, match=r"^speculative_model: .*empty: missing tokenizer.json$"):
        LLMEngine.from_pretrained(
            model_dir, device="cpu", num_speculative_tokens=4, speculative_model=str(tmp_path / "empty")
        )
    with pytest.raises(ValueError, match="^speculative_model drafts num_speculative_tokens"):
        EngineConfig(speculative_model=str(model_dir))
