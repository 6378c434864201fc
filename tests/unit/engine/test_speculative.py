"""Speculative decoding (n-gram prompt lookup): drafts verified in one forward, rejected
tokens rolled back in the paged cache, and the output exactly greedy's."""

from __future__ import annotations

import pytest
import torch

from lmops.runtime.engine import LLMEngine, SamplingParams
from lmops.runtime.engine import scheduler as scheduler_module
from lmops.runtime.engine.kv_cache import KVPool
from lmops.runtime.engine.scheduler import ngram_draft

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def test_ngram_draft_takes_the_latest_longest_match():
    assert ngram_draft([1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 1, 2, 3], 2) == [7, 6]  # latest of [1, 2, 3]
    assert ngram_draft([5, 1, 7, 2, 1], 4) == [7, 2, 1]  # only the last token recurs
    assert ngram_draft([4, 5, 6], 3) == []
    assert ngram_draft([8] * 6, 3) == [8, 8, 8]  # not the latest [8, 8, 8], which has one 8 after it
    # 261, 256 are bytes 05 01 00 00 | 00 01 00 00: token 1 (01 00 00 00) is in them, across
    # a token boundary, and is no match.
    assert ngram_draft([261, 256, 1], 3) == []


@pytest.mark.parametrize(
    "overrides",
    [{}, {"max_num_batched_tokens": 24}, {"block_size": 8, "kv_cache_memory": 40}],
    ids=["batched", "chunked", "preempted"],
)
def test_speculative_greedy_is_greedy(model_dir, ref_model, prompts, overrides, all_blocks_free):
    if "kv_cache_memory" in overrides:
        overrides["kv_cache_memory"] *= KVPool.bytes_per_block(ref_model.config, 8, torch.float32)
    # Echoed prompts, as in code edits: prompt lookup finds drafts, some right and some wrong.
    batch = [prompts[i] + prompts[i] for i in (2, 5, 8)] + [prompts[11]]
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True)
    params = [GREEDY, GREEDY, GREEDY, seeded]
    plain = LLMEngine.from_pretrained(model_dir, device="cpu", **overrides)
    spec = LLMEngine.from_pretrained(model_dir, device="cpu", num_speculative_tokens=4, **overrides)
    want = [o.token_ids for o in plain.generate(batch, params)]
    assert [o.token_ids for o in spec.generate(batch, params)] == want
    value = spec.metrics.registry.get_sample_value
    drafted, accepted = (
        value("lmops:spec_decode_num_draft_tokens_total"),
        value("lmops:spec_decode_num_accepted_tokens_total"),
    )
    assert 0 < accepted < drafted  # drafts were kept, and rejected ones rolled back
    assert value("lmops:generation_tokens_total") == 4 * 40
    if "kv_cache_memory" in overrides:
        assert value("lmops:num_preemptions_total") > 0
    all_blocks_free(spec)


@pytest.mark.parametrize("drafts", ["right", "wrong"])
def test_right_drafts_are_kept_and_wrong_ones_rolled_back(model_dir, prompts, drafts, monkeypatch):
    """With drafts that greedy decoding would (or would not) produce, the output is the
    same; right ones cut the steps five-fold (4 drafts + 1 per step), wrong ones are all
    rejected, and either way no block outlives the tokens it holds."""
    prompt = prompts[9]
    plain = LLMEngine.from_pretrained(model_dir, device="cpu")
    want = plain.generate([prompt], GREEDY)[0].token_ids

    def propose(token_ids, k):
        ahead = want[len(token_ids) - len(prompt) :][:k]
        return ahead if drafts == "right" else [(t + 1) % 512 for t in ahead]

    monkeypatch.setattr(scheduler_module, "ngram_draft", propose)
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", num_speculative_tokens=4)
    engine.add_request("r", prompt, GREEDY)
    steps, bm = 0, engine.block_manager
    while engine.has_unfinished_requests():
        out = engine.step()
        steps += 1
        assert all(len(s.block_table) <= bm.blocks_for(s.num_tokens) for s in engine.scheduler.running)
    assert out[0].token_ids == want
    value = engine.metrics.registry.get_sample_value
    drafted = value("lmops:spec_decode_num_draft_tokens_total")
    accepted = value("lmops:spec_decode_num_accepted_tokens_total")
    if drafts == "right":
        assert steps == 1 + 8 and accepted == drafted == 4 * 7 + 3  # the last step has room for 3
    else:
        assert steps == 1 + 39 and accepted == 0 and drafted > 100
