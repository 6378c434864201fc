"""Prompt log-probs (vLLM's prompt_logprobs, OpenAI's echo + logprobs): computed in the
prefill and equal to a plain full forward of the model, whatever the cache holds."""

from __future__ import annotations

import pytest
import torch

from lmops.runtime.engine import LLMEngine, SamplingParams
from lmops.runtime.engine.kv_cache import KVPool

PROMPT_ONLY = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=3)


@torch.no_grad()
def reference(model, ids: list[int], k: int) -> list[dict | None]:
    """The full forward's log-prob, rank and top-k of every prompt token after the first."""
    logprobs = torch.log_softmax(model(torch.tensor([ids]))[0][0, :-1].float(), -1)
    out: list[dict | None] = [None]
    for p, target in enumerate(ids[1:]):
        lp = logprobs[p, target]
        vals, top = logprobs[p].topk(k)
        out.append(
            {
                "token_id": target,
                "logprob": lp.item(),
                "rank": int((logprobs[p] > lp).sum()) + 1,
                "top": dict(zip(top.tolist(), vals.tolist(), strict=True)),
            }
        )
    return out


def assert_matches(got: list[dict | None], want: list[dict | None]) -> None:
    assert len(got) == len(want) and got[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert (g["token_id"], g["rank"]) == (w["token_id"], w["rank"])
        assert g["logprob"] == pytest.approx(w["logprob"], abs=1e-4)
        assert list(g["top"]) == list(w["top"])
        assert list(g["top"].values()) == pytest.approx(list(w["top"].values()), abs=1e-4)


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # several whole prompts per step
        {"max_num_batched_tokens": 24},  # chunked prefill: entries from several steps
        {"block_size": 16, "kv_cache_memory": 16, "max_num_batched_tokens": 40},  # preempted too
    ],
    ids=["batched", "chunked", "preempted"],
)
def test_equal_to_full_forward(model_dir, ref_model, prompts, overrides):
    if "kv_cache_memory" in overrides:
        overrides["kv_cache_memory"] *= KVPool.bytes_per_block(ref_model.config, 16, torch.float32)
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", **overrides)
    outs = engine.generate(
        prompts, SamplingParams(temperature=0, max_tokens=30, prompt_logprobs=3, ignore_eos=True)
    )
    for out, ids in zip(outs, prompts, strict=True):
        assert_matches(out.prompt_logprobs, reference(ref_model, ids, 3))
        assert len(out.token_ids) == 30


def test_exact_when_the_prefix_is_cached(model_dir, ref_model, prompts, all_blocks_free):
    """A cached prefix would skip its prefill: a request that wants prompt log-probs is
    prefilled whole, and the others still hit the cache."""
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", block_size=16)
    shared = prompts[13][:64]
    warm = engine.generate(shared + prompts[2][:4], SamplingParams(temperature=0, max_tokens=1))[0]
    assert warm.prompt_logprobs is None
    ids = shared + prompts[3][:6]
    [out] = engine.generate(ids, PROMPT_ONLY)
    assert out.metrics.num_cached_tokens == 0
    assert_matches(out.prompt_logprobs, reference(ref_model, ids, 3))
    again = engine.generate(shared + prompts[4][:6], SamplingParams(temperature=0, max_tokens=1))[0]
    assert again.metrics.num_cached_tokens >= 64
    all_blocks_free(engine)


def test_max_tokens_zero_and_n(model_dir, ref_model, prompts, all_blocks_free):
    """max_tokens 0 prefills only (n completions, empty, finish_reason "length");
    a one-token prompt has only the leading None."""
    engine = LLMEngine.from_pretrained(model_dir, device="cpu")
    one, many = engine.generate(
        [prompts[0][:1], prompts[5]], [PROMPT_ONLY, SamplingParams(max_tokens=0, n=3, prompt_logprobs=0)]
    )
    assert one.prompt_logprobs == [None] and one.token_ids == [] and one.finish_reason == "length"
    assert [o.token_ids for o in many.outputs] == [[], [], []]
    assert all(e["top"] == {} for e in many.prompt_logprobs[1:])
    want = [e["logprob"] for e in reference(ref_model, prompts[5], 1)[1:]]
    assert [e["logprob"] for e in many.prompt_logprobs[1:]] == pytest.approx(want, abs=1e-4)
    assert engine.metrics.registry.get_sample_value("lmops:generation_tokens_total") == 0
    all_blocks_free(engine)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_validated(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
