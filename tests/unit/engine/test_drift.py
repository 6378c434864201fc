"""The drift signal: the prompt's bits per byte, scored on the prefill of sampled requests."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from lmops.runtime.engine import LLMEngine, SamplingParams
from lmops.runtime.engine.config import EngineConfig
from lmops.runtime.engine.kv_cache import KVPool
from lmops.runtime.tokenizer import token_byte_lengths

ONE = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


@torch.no_grad()
def reference_bpb(model, tokenizer, ids: list[int]) -> float:
    """evaluate.score's unit on one prompt: a plain full forward, NLL of tokens 1.. over their bytes."""
    logits, _ = model(torch.tensor([ids]))
    nll = F.cross_entropy(logits[0, :-1].float(), torch.tensor(ids[1:]), reduction="sum").item()
    return nll / math.log(2) / int(token_byte_lengths(tokenizer)[ids[1:]].sum())


def scores(outs) -> list[float | None]:
    return [o.metrics.prompt_bits_per_byte for o in outs]


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # whole prompts in one step, several per batch
        {"max_num_batched_tokens": 24},  # chunked prefill: scores add up across chunks
        # (kv_cache_memory in blocks) preemption by recompute, prefills chunked too
        {"block_size": 16, "kv_cache_memory": 16, "max_num_batched_tokens": 40},
    ],
    ids=["batched", "chunked", "preempted"],
)
def test_score_equals_full_forward(model_dir, ref_model, tokenizer, prompts, overrides):
    if "kv_cache_memory" in overrides:
        overrides["kv_cache_memory"] *= KVPool.bytes_per_block(ref_model.config, 16, torch.float32)
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", drift_sample=1.0, **overrides)
    outs = engine.generate(prompts, replace(ONE, max_tokens=40))
    if "kv_cache_memory" in overrides:
        assert engine.metrics.registry.get_sample_value("lmops:num_preemptions_total") > 0
    want = [reference_bpb(ref_model, tokenizer, p) for p in prompts]
    assert scores(outs) == pytest.approx(want, rel=1e-4)
    hist = engine.metrics.registry.get_sample_value("lmops:prompt_bits_per_byte_count")
    assert hist == len(prompts)


def test_cached_prefix_is_still_scored(model_dir, ref_model, tokenizer, prompts):
    """A prompt whose prefix sits in the cache is scored over all of its tokens (it is
    prefilled whole); unscored requests keep using the cache."""
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", drift_sample=0.5)
    shared = prompts[13][:64]
    batch = [shared + prompts[i][:6] for i in (2, 3, 4, 5)]
    outs = [engine.generate(p, ONE)[0] for p in batch]  # one at a time: the cache is warm after the first
    assert scores(outs)[0::2] == [None, None]  # every 2nd request (systematic sampling) is scored
    for out, p in zip(outs[1::2], batch[1::2], strict=True):
        assert out.metrics.num_cached_tokens == 0
        assert out.metrics.prompt_bits_per_byte == pytest.approx(
            reference_bpb(ref_model, tokenizer, p), rel=1e-4
        )
    assert outs[2].metrics.num_cached_tokens >= 64


def test_sample_rate(model_dir, prompts):
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", drift_sample=0.25)
    assert sum(s is not None for s in scores(engine.generate(prompts, ONE))) == len(prompts) // 4
    off = LLMEngine.from_pretrained(model_dir, device="cpu", drift_sample=0)
    assert scores(off.generate(prompts, ONE)) == [None] * len(prompts)
    assert off.metrics.registry.get_sample_value("lmops:prompt_bits_per_byte_count") == 0
    assert EngineConfig().drift_sample == 0.1


def test_a_request_may_ask_for_its_score_whatever_the_sample(model_dir, ref_model, tokenizer, prompts):
    """The service's shadow mode scores the prompts it mirrors on both models."""
    off = LLMEngine.from_pretrained(model_dir, device="cpu", drift_sample=0)
    asked = off.make_request(None, prompts[0], ONE, score_prompt=True)
    asked.final_only = True
    off.add_request(None, asked)
    off.add_request("plain", prompts[1], ONE)
    outs = {}
    while off.has_unfinished_requests():
        outs.update((o.request_id, o) for o in off.step() if o.finished)
    assert outs[asked.request_id].metrics.prompt_bits_per_byte == pytest.approx(
        reference_bpb(ref_model, tokenizer, prompts[0]), rel=1e-4
    )
    assert outs["plain"].metrics.prompt_bits_per_byte is None


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.1", True, float("nan")])
def test_drift_sample_is_validated(bad):
    with pytest.raises(ValueError, match="drift_sample"):
        EngineConfig(drift_sample=bad)


def test_reference_gauge_only_when_set(model_dir):
    engine = LLMEngine.from_pretrained(model_dir, device="cpu")
    assert engine.metrics.registry.get_sample_value("lmops:model_reference_bits_per_byte") is None
    engine.metrics.set_reference_bits_per_byte(2.5)
    assert engine.metrics.registry.get_sample_value("lmops:model_reference_bits_per_byte") == 2.5
