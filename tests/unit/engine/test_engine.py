"""LLMEngine's public surface: generate, validation, abort, seeds, n, logprobs, metrics."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest

from lmops.errors import LmopsError
from lmops.runtime.engine import LLMEngine, PromptTooLongError, SamplingParams
from lmops.runtime.engine.kv_cache import KVPool


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine.from_pretrained(model_dir, device="cpu", block_size=16)


def test_generate_returns_text_tokens_reason_and_metrics(engine):
    outs = engine.generate(
        ["def add(a, b):", "for i in range(3):"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    assert len(outs) == 2 and outs[0].prompt == "def add(a, b):"
    for o in outs:
        assert o.finished and o.finish_reason == "length" and len(o.token_ids) == 8
        assert o.text == engine.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        m = o.metrics
        assert m.num_prompt_tokens == len(o.prompt_token_ids) and m.num_generation_tokens == 8
        assert 0 <= m.queue_time <= m.ttft <= m.e2e_latency and m.tpot > 0
    assert engine.max_model_len == 256


def test_prompt_validation(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.generate([""])
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(None, [], SamplingParams())
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        engine.add_request(None, [1, 512], SamplingParams())
    with pytest.raises(PromptTooLongError, match="256 tokens.*300 tokens|300 tokens.*256 tokens") as exc:
        engine.add_request(None, [5] * 300, SamplingParams())
    assert isinstance(exc.value, ValueError) and "255" in str(exc.value)
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request(None, [5, 6], SamplingParams(n=65))
    rid = engine.add_request("dup", [5, 6], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [5, 6], SamplingParams())
    while engine.has_unfinished_requests():
        engine.step()
    assert rid == "dup" and not engine.requests


def test_max_tokens_is_clipped_to_the_context(engine):
    out = engine.generate([[5] * 255], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 1
    out = engine.generate([[5] * 250], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.token_ids) == 6


def test_abort_frees_every_block(model_dir, prompts, all_blocks_free):
    per_block = KVPool.bytes_per_block(
        LLMEngine.from_pretrained(model_dir, device="cpu").model_config, 16, torch.float32
    )
    engine = LLMEngine.from_pretrained(
        model_dir, device="cpu", block_size=16, kv_cache_memory=24 * per_block, max_num_batched_tokens=64
    )
    params = SamplingParams(temperature=0.9, seed=1, max_tokens=60, ignore_eos=True)
    forked = engine.add_request(None, prompts[4], SamplingParams(n=3, max_tokens=60, ignore_eos=True))
    ids = [engine.add_request(None, p, params) for p in prompts[4:12]]
    for _ in range(6):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0 and engine.scheduler.waiting
    assert len(engine.requests[forked].seqs) == 3  # forked, sharing the prompt's blocks
    out = engine.abort(forked)
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert engine.abort(ids[-1]).finish_reason == "abort"  # still waiting: never scheduled
    assert engine.abort("no-such-request") is None
    for rid in ids[:3]:
        engine.abort(rid)
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id in ids[3:-1]
    all_blocks_free(engine)
    assert (
        engine.metrics.registry.get_sample_value("lmops:request_success_total", {"finished_reason": "abort"})
        == 5
    )


def test_same_seed_same_text_whatever_the_batch(model_dir, prompts):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=30)
    alone = LLMEngine.from_pretrained(model_dir, device="cpu").generate([prompts[6]], params)[0]
    busy = LLMEngine.from_pretrained(model_dir, device="cpu", max_num_batched_tokens=40, block_size=8)
    mates = [
        SamplingParams(temperature=0.7, max_tokens=25),
        SamplingParams(temperature=1.0, seed=9),
        SamplingParams(temperature=0),
    ]
    batch = [prompts[i] for i in range(10)] + [prompts[6]]
    outs = busy.generate(batch, [mates[i % 3] for i in range(10)] + [params])
    assert outs[-1].token_ids == alone.token_ids and outs[-1].text == alone.text
    other = LLMEngine.from_pretrained(model_dir, device="cpu").generate(
        [prompts[6]], SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=30)
    )[0]
    assert other.token_ids != alone.token_ids


def test_n_seeded_completions_differ_and_reproduce(engine, prompts):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)
    a, b = engine.generate([prompts[3], prompts[3]], params)
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3
    assert a.metrics.num_generation_tokens == 60


def test_logprobs_in_outputs(engine, prompts):
    out = engine.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, lps, strict=True):
        assert lp["token_id"] == tok and len(lp["top"]) == 3
        assert max(lp["top"], key=lp["top"].get) == tok  # greedy picks the top-1
        assert lp["logprob"] == pytest.approx(lp["top"][tok]) and lp["logprob"] <= 0


def test_prometheus_metrics(model_dir, prompts):
    engine = LLMEngine.from_pretrained(model_dir, device="cpu")
    shared = [prompts[12][:64] + [7 + i] for i in range(4)]
    outs = engine.generate(shared, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    value = engine.metrics.registry.get_sample_value
    assert value("lmops:prompt_tokens_total") == sum(len(p) for p in shared)
    assert value("lmops:generation_tokens_total") == 20
    assert value("lmops:prefix_cache_queries_total") == sum(len(p) for p in shared)
    assert value("lmops:prefix_cache_hits_total") == 3 * 64  # later requests hit the 4 blocks
    assert value("lmops:request_success_total", {"finished_reason": "length"}) == 4
    assert value("lmops:time_to_first_token_seconds_count") == 4
    assert value("lmops:time_per_output_token_seconds_count") == 16
    assert value("lmops:e2e_request_latency_seconds_count") == 4
    assert value("lmops:request_queue_time_seconds_count") == 4
    assert value("lmops:num_requests_running") == 0 and value("lmops:num_requests_waiting") == 0
    assert value("lmops:kv_cache_usage_perc") == 0
    assert value("lmops:num_preemptions_total") == 0
    cache = {"block_size": "16", "num_gpu_blocks": str(len(engine.block_manager.blocks))}
    assert value("lmops:cache_config_info", {**cache, "enable_prefix_caching": "True"}) == 1
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 64, 64, 64]
    text = generate_latest(engine.metrics.registry).decode()
    assert "lmops:kv_cache_usage_perc" in text
    # Gauges move while work is in flight (ignore_eos: a sampled first EOS would finish one).
    in_flight = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request(None, prompts[3], in_flight)
    engine.add_request(None, prompts[4], in_flight)
    engine.step()
    assert value("lmops:num_requests_running") == 2 and value("lmops:kv_cache_usage_perc") > 0


def test_model_directory_errors(tmp_path, model_dir):
    with pytest.raises(LmopsError, match="not found"):
        LLMEngine.from_pretrained(tmp_path / "missing")
    with pytest.raises(LmopsError, match="tokenizer.json"):
        LLMEngine.from_pretrained(tmp_path)
    with pytest.raises(LmopsError, match="at least"):
        LLMEngine.from_pretrained(model_dir, device="cpu", kv_cache_memory=1000)
    with pytest.raises(LmopsError, match="dtype"):
        LLMEngine.from_pretrained(model_dir, device="cpu", dtype="int8")
    with pytest.raises(LmopsError, match="max_num_seqs must be an integer >= 1"):
        LLMEngine.from_pretrained(model_dir, device="cpu", max_num_seqs=0)
    with pytest.raises(LmopsError, match="unexpected keyword argument 'max_seqs'"):
        LLMEngine.from_pretrained(model_dir, device="cpu", max_seqs=4)
