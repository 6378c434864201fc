"""Correctness against references: greedy through the engine == full recompute, and the
paged path's logits == the contiguous KVCache path's, under every scheduling regime."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from lmops.runtime.engine import LLMEngine, SamplingParams
from lmops.runtime.engine.forward import FusedForward
from lmops.runtime.engine.kv_cache import KVPool
from lmops.runtime.model import KVCache

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_fixture_is_sensitive_to_context(ref_model, prompts, greedy_reference):
    """Guards the other tests: with this model, a wrong attention changes the tokens."""
    p = prompts[5]
    changed = [(p[0] + 7) % ref_model.config.vocab_size] + p[1:]
    assert greedy_reference(ref_model, p, 12) != greedy_reference(ref_model, changed, 12)


def test_greedy_alone_matches_full_recompute(
    model_dir, ref_model, prompts, greedy_reference, all_blocks_free
):
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", block_size=16)
    for p in (prompts[0], prompts[9]):
        out = engine.generate([p], GREEDY)[0]
        assert out.token_ids == greedy_reference(ref_model, p, GREEDY.max_tokens)
        assert out.finish_reason == "length"
    all_blocks_free(engine)


@pytest.fixture(scope="module")
def references(ref_model, prompts, greedy_reference):
    return [greedy_reference(ref_model, p, GREEDY.max_tokens) for p in prompts]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_batch_of_16_mixed_lengths(model_dir, prompts, references, prefix_caching, all_blocks_free):
    engine = LLMEngine.from_pretrained(
        model_dir, device="cpu", block_size=16, enable_prefix_caching=prefix_caching
    )
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == references
    all_blocks_free(engine)


def test_preemption_with_tiny_pool(model_dir, prompts, references, ref_model, all_blocks_free):
    """16 blocks (one max-length sequence) for 16 sequences: preemption must happen."""
    per_block = KVPool.bytes_per_block(ref_model.config, 16, torch.float32)
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", block_size=16, kv_cache_memory=16 * per_block)
    assert engine.block_manager.num_blocks == 16
    outs = engine.generate(prompts, GREEDY)
    assert engine.metrics.registry.get_sample_value("lmops:num_preemptions_total") > 0
    assert [o.token_ids for o in outs] == references
    all_blocks_free(engine)


def test_preemption_without_prefix_caching(model_dir, prompts, references, ref_model, all_blocks_free):
    per_block = KVPool.bytes_per_block(ref_model.config, 8, torch.float32)
    engine = LLMEngine.from_pretrained(
        model_dir, device="cpu", block_size=8, kv_cache_memory=40 * per_block, enable_prefix_caching=False
    )
    outs = engine.generate(prompts[6:], GREEDY)
    assert engine.metrics.registry.get_sample_value("lmops:num_preemptions_total") > 0
    assert [o.token_ids for o in outs] == references[6:]
    all_blocks_free(engine)


def test_chunked_prefill(model_dir, prompts, references, all_blocks_free):
    """A 20-token step budget: long prompts are prefilled over several steps, mixed with decodes."""
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", block_size=16, max_num_batched_tokens=20)
    chunks = []
    execute = engine.runner.execute

    def spy(batch):
        chunks.extend(
            n
            for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
            if n > 1 and s.num_computed_tokens + n < s.num_tokens
        )
        assert sum(batch.num_new_tokens) <= 20
        return execute(batch)

    engine.runner.execute = spy
    outs = engine.generate(prompts[8:], GREEDY)
    assert chunks, "no prompt was split across steps"
    assert [o.token_ids for o in outs] == references[8:]
    all_blocks_free(engine)


def test_prefix_cache_hits_and_parity(
    model_dir, tokenizer, ref_model, prompts, greedy_reference, all_blocks_free
):
    base = prompts[12][:70]
    shared = [base + p[: 3 + i] for i, p in enumerate(prompts[:6])]
    refs = [greedy_reference(ref_model, p, 12) for p in shared]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # drift_sample=0: a prompt scored for the drift signal is prefilled whole (no cache hits).
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", block_size=16, drift_sample=0)
    assert [o.token_ids for o in engine.generate(shared, params)] == refs
    hits = engine.metrics.registry.get_sample_value("lmops:prefix_cache_hits_total")
    assert hits >= 5 * 64  # the 4 full blocks of the shared prefix, for every later request
    # Run again: the freed blocks are still cached, so even the first request hits now.
    outs = engine.generate(shared, params)
    assert [o.token_ids for o in outs] == refs
    assert outs[0].metrics.num_cached_tokens >= 64
    assert engine.metrics.registry.get_sample_value("lmops:prefix_cache_hits_total") - hits >= 6 * 64
    all_blocks_free(engine)


def test_n_completions_share_prompt_blocks(model_dir, prompts, references, all_blocks_free):
    """n=3 greedy: every completion equals the reference; the shared partial block is copied."""
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", block_size=16)
    copies = []
    execute = engine.runner.execute

    def spy(batch):
        copies.extend(batch.copies)
        return execute(batch)

    engine.runner.execute = spy
    p = prompts[4]  # 36 tokens: the prompt's last block is partly filled
    out = engine.generate([p], SamplingParams(n=3, temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == references[4] for c in out.outputs)
    assert len(copies) == 2  # two of the three siblings copy the shared partial block
    all_blocks_free(engine)


def test_paged_logits_equal_contiguous_logits(model_dir, ref_model, prompts):
    """Every logit row the engine samples from (chunked prefills, decodes in groups of
    different context lengths, prefix hits) equals the contiguous KVCache path's to 1e-5."""
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", block_size=8, max_num_batched_tokens=48)
    seen: dict[int, list[tuple[int, torch.Tensor]]] = {}
    execute = engine.runner.execute

    def spy(batch):
        output = execute(batch)
        for i, row in zip(batch.ready, output.logits, strict=True):
            s = batch.seqs[i]
            seen.setdefault(s.seq_id, []).append((s.num_tokens - 1, row.clone()))
        return output

    engine.runner.execute = spy
    groups = []
    prepare = engine.runner.prepare

    def prepare_spy(seqs, num_new):
        out = prepare(seqs, num_new)
        groups.extend((g.n, (g.rows.stop - g.rows.start) // g.n) for g in out[2].groups)
        return out

    engine.runner.prepare = prepare_spy
    # Three prompts of one 64-token prefix and 5 own tokens: the later two hit the cache in
    # the same step and attend as one group of 5-token queries over cached context.
    shared = [prompts[13][:64] + prompts[i][:5] for i in (3, 4, 5)]
    batch = [prompts[i] for i in (1, 7, 10, 15)] + [prompts[10][:60] + prompts[2]] + shared
    outs = engine.generate(batch, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert len(seen) == len(batch)
    checked = 0
    for seq_id, out in zip(sorted(seen), outs, strict=True):
        ids = out.prompt_token_ids + out.token_ids
        cache = KVCache(ref_model.config, 1, len(ids), "cpu", torch.float32)
        with torch.no_grad():
            ref = torch.cat(
                [
                    ref_model(torch.tensor([[t]]), positions=torch.tensor([[i]]), cache=cache)[0][0]
                    for i, t in enumerate(ids)
                ]
            )
        for pos, row in seen[seq_id]:
            torch.testing.assert_close(row, ref[pos], atol=1e-5, rtol=0)
            checked += 1
    assert checked == sum(len(v) for v in seen.values()) >= 8 * 20
    assert (5, 2) in groups  # the grouped path for multi-token queries really ran


def causal(layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Plain causal attention over one packed sequence, in forward.py's layout."""
    k, v = kv.transpose(0, 1)[None].chunk(2, 1)
    y = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True, enable_gqa=True)
    return y[0].transpose(0, 1)


def test_fused_forward_is_the_models_forward(ref_model, prompts):
    """forward.py restates model.py's layers (fused projections, RoPE from a table): with
    the same attention, the same logits; and the check sees the last token's RoPE one
    position off (shifting every position would not do: RoPE only sees distances)."""
    fused = FusedForward(copy.deepcopy(ref_model))  # it re-points the copy's weights
    ids = torch.tensor(prompts[9])
    positions = torch.arange(len(ids))
    with torch.no_grad():
        want = ref_model(ids[None])[0][0]
        got = fused.logits(fused(ids, positions, causal))
        shifted = fused.logits(fused(ids, torch.cat((positions[:-1], positions[-1:] + 1)), causal))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert not torch.allclose(shifted, want, atol=1e-3, rtol=0)
