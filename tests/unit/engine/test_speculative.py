"""Speculative decoding (n-gram prompt lookup): drafts verified in one forward, rejected
tokens rolled back in the paged cache; the output exactly greedy's for greedy requests and
distributed exactly as without a draft for sampled ones (rejection sampling)."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest
import torch

from lmops.runtime.engine import LLMEngine, SamplingParams
from lmops.runtime.engine import sampling as sampling_module
from lmops.runtime.engine import scheduler as scheduler_module
from lmops.runtime.engine.compiled import lookup_draft
from lmops.runtime.engine.kv_cache import KVPool
from lmops.runtime.engine.sampling import race, residual, verify_draft
from lmops.runtime.engine.scheduler import ngram_draft

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# Greedy over penalized logits: each draft row's penalties count the draft tokens before it.
PENALIZED = SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=40, ignore_eos=True)


def test_ngram_draft_takes_the_latest_longest_match():
    assert ngram_draft([1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 1, 2, 3], 2) == [7, 6]  # latest of [1, 2, 3]
    assert ngram_draft([5, 1, 7, 2, 1], 4) == [7, 2, 1]  # only the last token recurs
    assert ngram_draft([4, 5, 6], 3) == []
    assert ngram_draft([8] * 6, 3) == [8, 8, 8]  # not the latest [8, 8, 8], which has one 8 after it
    # 261, 256 are bytes 05 01 00 00 | 00 01 00 00: token 1 (01 00 00 00) is in them, across
    # a token boundary, and is no match.
    assert ngram_draft([261, 256, 1], 3) == []
    assert ngram_draft([5, 1, 7, 2, 1], 4, min_n=2) == []  # a match of 2 tokens or more only
    assert ngram_draft([1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 1, 2], 2, min_n=2) == [3, 7]


def test_lookup_draft_is_ngram_draft_in_tensors():
    """The compiled lookup run's drafter (compiled.lookup_draft) finds what ngram_draft finds,
    on the cases above and on 2,000 random sequences of small vocabularies (many matches,
    of every length), for matches of any length and of 2 tokens or more: ngram_draft's
    tokens first, and as many counted as the sequence's own (the rest read past the tokens:
    `length` hides them from the search only)."""
    rng = random.Random(0)
    cases = [([1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 1, 2, 3], 2), ([5, 1, 7, 2, 1], 4), ([4, 5, 6], 3), ([8] * 6, 3)]
    cases += [
        ([rng.randrange(rng.choice([2, 3, 5, 20])) for _ in range(rng.randint(1, 40))], rng.choice([1, 2, 4]))
        for _ in range(2000)
    ]
    for (tokens, k), min_n in itertools.product(cases, (1, 2)):
        history = torch.tensor(tokens + [rng.randrange(20) for _ in range(8)])  # what lies past them
        draft, own = lookup_draft(history, torch.tensor([len(tokens)]), k, min_n=min_n)
        want = ngram_draft(tokens, k, min_n=min_n)
        assert own.tolist() == [len(want)], (tokens, k, min_n)
        assert draft.shape == (k,) and draft.tolist()[: len(want)] == want, (tokens, k, min_n)


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
    params = [GREEDY, PENALIZED, GREEDY, seeded]  # a sampled request in the batch, drafting too
    plain = LLMEngine.from_pretrained(model_dir, device="cpu", **overrides)
    spec = LLMEngine.from_pretrained(model_dir, device="cpu", num_speculative_tokens=4, **overrides)
    want = [o.token_ids for o in plain.generate(batch, params)]
    got = [o.token_ids for o in spec.generate(batch, params)]
    assert got[:3] == want[:3] and len(got[3]) == 40
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


def test_residual_and_acceptance_on_hand_made_distributions():
    """The math: draft token d is kept with probability p(d), a rejection draws from p
    without d (renormalized), and together they give p back; all kept, the bonus token is
    drawn from the last row."""
    p = torch.tensor([0.5, 0.3, 0.2])
    assert torch.allclose(residual(p, 1), torch.tensor([5 / 7, 0, 2 / 7]))
    assert torch.allclose(p[1] * torch.eye(3)[1] + (1 - p[1]) * residual(p, 1), p)
    bonus = torch.tensor([0.1, 0.1, 0.8])
    g = torch.Generator().manual_seed(0)
    draws = 20_000
    verdicts = Counter(verify_draft(torch.stack([p, bonus]), [1], g) for _ in range(draws))
    first = Counter({t: n for (kept, t), n in verdicts.items() if kept == 0})
    kept = sum(n for (k, _), n in verdicts.items() if k == 1)
    assert first[1] == 0  # a rejected draft token is never drawn again
    assert abs(kept / draws - 0.3) < 0.015
    for token, prob in enumerate([0.5, 0.3, 0.2]):  # the first token: the draft's or the residual's
        assert abs(((first[token] + (kept if token == 1 else 0)) / draws) - prob) < 0.015
    for token, prob in enumerate(bonus.tolist()):
        assert abs(verdicts[(1, token)] / kept - prob) < 0.03
    certain, impossible = torch.tensor([[0.0, 1.0, 0.0]] * 3), torch.tensor([[0.6, 0.0, 0.4]] * 3)
    assert all(verify_draft(certain, [1, 1], g) == (2, 1) for _ in range(100))
    assert all(verify_draft(impossible, [1, 1], g)[0] == 0 for _ in range(100))
    assert Counter(verify_draft(impossible, [1, 1], g)[1] for _ in range(100)).keys() == {0, 2}


def _chi_square_agrees(a: Counter, b: Counter) -> bool:
    """Two samples from one distribution, by Pearson's chi-square test of homogeneity at the
    0.1% level (cells seen fewer than 10 times are pooled; the critical value is
    Wilson-Hilferty's approximation of the chi-square quantile)."""
    na, nb = sum(a.values()), sum(b.values())
    cells = [(a[c], b[c]) for c in a.keys() | b.keys() if a[c] + b[c] >= 10]
    rare = [(a[c], b[c]) for c in a.keys() | b.keys() if a[c] + b[c] < 10]
    cells.append((sum(x for x, _ in rare), sum(y for _, y in rare)))
    stat = 0.0
    for x, y in cells:
        if x + y:
            ea, eb = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
            stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    df = len(cells) - 1
    z = 3.09  # the standard normal's 99.9% quantile
    return stat < df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


DRAWS = 3000
SAMPLED = [
    SamplingParams(temperature=1.0, top_k=5, seed=i, max_tokens=4, ignore_eos=True) for i in range(DRAWS)
]


@pytest.fixture(scope="module")
def unspeculated(model_dir, prompts):
    """DRAWS seeded samples of a prompt's first 3 tokens without speculation, and each first
    token's greedy continuation (the draft the tests propose after it)."""
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", drift_sample=0, max_num_seqs=256)
    prompt = prompts[1]
    outs = [o.token_ids[:3] for o in engine.generate([prompt] * DRAWS, SAMPLED)]
    firsts = sorted({out[0] for out in outs})
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outs_ahead = engine.generate([prompt + [t] for t in firsts], greedy)
    ahead = {t: o.token_ids for t, o in zip(firsts, outs_ahead, strict=True)}
    return prompt, outs, ahead


def _always_accept(probs, draft, generator):
    return len(draft), int(race(probs[-1:], [generator])[0])


@pytest.mark.parametrize("rule", ["rejection", "always accept", "resample from p"])
def test_sampled_speculation_keeps_the_distribution(model_dir, unspeculated, rule, monkeypatch):
    """The first speculative step's tokens (the 2nd and 3rd, after a 2-token draft: the
    greedy continuation, kept about 1 time in 5 at temperature 1) are distributed as without
    speculation, by the chi-square test; the test can fail: it rejects a verifier that keeps
    every draft, or that redraws a rejected token from p instead of the residual."""
    prompt, want, ahead = unspeculated

    def propose(token_ids, k):
        out = token_ids[len(prompt) :]
        return ahead[out[0]][len(out) - 1 :][:k] if out else []

    monkeypatch.setattr(scheduler_module, "ngram_draft", propose)
    if rule == "always accept":
        monkeypatch.setattr(sampling_module, "verify_draft", _always_accept)
    elif rule == "resample from p":
        monkeypatch.setattr(sampling_module, "residual", lambda p, token: p)
    engine = LLMEngine.from_pretrained(
        model_dir, device="cpu", drift_sample=0, max_num_seqs=256, num_speculative_tokens=2
    )
    got = [o.token_ids[:3] for o in engine.generate([prompt] * DRAWS, SAMPLED)]
    value = engine.metrics.registry.get_sample_value
    assert value("lmops:spec_decode_num_draft_tokens_total") >= 2 * DRAWS
    agree = [_chi_square_agrees(Counter(w[i] for w in want), Counter(g[i] for g in got)) for i in (1, 2)]
    agree.append(_chi_square_agrees(Counter(map(tuple, want)), Counter(map(tuple, got))))  # jointly
    assert agree == [rule == "rejection"] * 3


def test_seeded_sampled_speculation_is_reproducible(model_dir, prompts, all_blocks_free):
    """Sampled requests (top-p, penalties, min_p, n=2) draft too: with seeds, two engines
    give the same tokens, and drafts were both kept and rejected."""
    batch = [prompts[i] + prompts[i] for i in (2, 5, 8)]
    params = [
        SamplingParams(temperature=0.3, top_p=0.9, seed=1, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.3, repetition_penalty=1.05, seed=2, n=2, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.3, min_p=0.1, frequency_penalty=0.1, seed=3, max_tokens=40),
    ]
    runs = []
    for _ in range(2):
        engine = LLMEngine.from_pretrained(model_dir, device="cpu", num_speculative_tokens=4)
        runs.append([[c.token_ids for c in o.outputs] for o in engine.generate(batch, params)])
        value = engine.metrics.registry.get_sample_value
        drafted = value("lmops:spec_decode_num_draft_tokens_total")
        assert 0 < value("lmops:spec_decode_num_accepted_tokens_total") < drafted
        all_blocks_free(engine)
    assert runs[0] == runs[1]
