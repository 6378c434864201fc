"""SamplingParams validation and the batched sampler's semantics."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from lmops.runtime.engine import SamplingParams
from lmops.runtime.engine.sampling import (
    GRAPH_CANDIDATES,
    GREEDY_BELOW,
    OPTIONAL,
    RANGES,
    TOP_CANDIDATES,
    apply_filters,
    apply_penalties,
    batch_draw_inputs,
    plain_draw,
    plain_draw_inputs,
    sample,
)


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("n", 0, ">= 1"),
        ("n", 1.5, ">= 1"),
        ("temperature", -0.1, "[0, 2]"),
        ("temperature", 2.5, "[0, 2]"),  # the API's cap, stated once here
        ("temperature", math.nan, "[0, 2]"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.1, "(0, 1]"),
        ("top_k", -2, "0 / -1"),
        ("min_p", 1.5, "[0, 1]"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -3, "[-2, 2]"),
        ("repetition_penalty", 0, "(0, 2]"),
        ("max_tokens", -1, ">= 0"),
        ("stop", ["ok", ""], "non-empty"),
        ("stop", 5, "non-empty"),
        ("stop_token_ids", [-1], "token ids"),
        ("seed", "7", "integer"),
        ("seed", 2**63, "64-bit"),
        ("logprobs", 21, "[0, 20]"),
        ("logprobs", -1, "[0, 20]"),
        ("ignore_eos", 1, "bool"),
    ],
)
def test_invalid_values_name_field_and_range(field, value, allowed):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**{field: value})
    assert field in str(exc.value) and allowed in str(exc.value)


def test_valid_values_and_normalisation():
    p = SamplingParams(stop="###", top_k=-1, max_tokens=None, logprobs=0, seed=-5)
    assert p.stop == ["###"] and p.stop_token_ids == []
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


def test_every_range_and_optional_field_is_a_sampling_field():
    """RANGES is what the API's request schema publishes: no bound for a field that is not there."""
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(RANGES) <= fields and OPTIONAL.issubset(RANGES)


def row(params, generator=None, prompt=(), output=()):
    return SimpleNamespace(
        params=params, generator=generator, prompt_token_ids=list(prompt), output_token_ids=list(output)
    )


def gen(seed):
    return torch.Generator().manual_seed(seed)


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])


def test_seeded_rows_ignore_batch_mates():
    p = SamplingParams(temperature=1.0, seed=11)
    alone_gen, batch_gen = gen(11), gen(11)
    alone, batched = [], []
    noise = torch.randn(5, 6)
    for _ in range(50):
        alone.append(sample(LOGITS[None], [row(p, alone_gen)]).token_ids[0])
        logits = torch.cat([noise, LOGITS[None], noise])
        rows = (
            [row(SamplingParams(temperature=0.7))] * 5
            + [row(p, batch_gen)]
            + [row(SamplingParams(temperature=0))] * 5
        )
        batched.append(sample(logits, rows).token_ids[5])
    assert alone == batched
    assert len(set(alone)) > 1  # actually random


def test_draws_follow_the_distribution():
    """20000 seeded draws: each frequency within 0.015 of softmax (deterministic, no flakes)."""
    g = gen(0)
    logits = LOGITS[None].expand(20000, -1)
    rows = [row(SamplingParams(temperature=1.0), g)] * 20000
    counts = torch.bincount(torch.tensor(sample(logits, rows).token_ids), minlength=6).float()
    assert torch.allclose(counts / 20000, LOGITS.softmax(-1), atol=0.015)


def test_temperature_sharpens():
    g = gen(1)
    rows = [row(SamplingParams(temperature=0.25), g)] * 4000
    ids = torch.tensor(sample(LOGITS[None].expand(4000, -1), rows).token_ids)
    assert (ids == 0).float().mean() > 0.85  # p(0) = softmax(4 * logits)[0] ~ 0.87


@pytest.mark.parametrize(
    ("kw", "allowed"),
    [
        ({"top_k": 2}, {0, 1}),
        ({"top_p": 0.6}, {0, 1}),  # probs 0.50, 0.30, 0.18, ...: 0.5 < 0.6, 0.8 >= 0.6
        ({"min_p": 0.5}, {0, 1}),  # p(1)/p(0) = 0.61, p(2)/p(0) = 0.37
        ({"top_k": 1}, {0}),
        ({"top_p": 0.01}, {0}),
    ],
)
def test_filters_restrict_the_support(kw, allowed):
    g = gen(2)
    rows = [row(SamplingParams(temperature=1.0, **kw), g)] * 3000
    ids = set(sample(LOGITS[None].expand(3000, -1), rows).token_ids)
    assert ids == allowed


def filters_by_full_sort(logits, params):
    """top_k and top_p by their definition: every token ranked, ascending, the tail whose
    cumulative probability is at most 1 - top_p dropped."""
    V = logits.shape[1]
    srt, order = logits.sort(-1)
    k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params])
    srt = srt.masked_fill(srt < srt.gather(1, (V - k)[:, None]), -math.inf)
    drop = srt.softmax(-1).cumsum(-1) <= 1 - torch.tensor([p.top_p for p in params])[:, None]
    drop[:, -1] = False
    return torch.empty_like(logits).scatter_(-1, order, srt.masked_fill(drop, -math.inf))


def test_filters_rank_a_candidate_set_and_keep_what_a_full_sort_keeps():
    """Peaked rows, whose kept tokens are among the TOP_CANDIDATES most likely, and flat ones,
    whose top_p needs the whole vocabulary; top_k below and above the candidate set; a row
    without filters in the same batch."""
    g = gen(3)
    peaked, flat = torch.randn(6, 4096, generator=g) * 6, torch.randn(6, 4096, generator=g) * 0.3
    kinds = [
        {"top_p": 0.9},
        {"top_p": 0.999},
        {"top_k": 5},
        {"top_k": TOP_CANDIDATES + 300, "top_p": 0.95},
        {"top_k": 50, "top_p": 0.5},
        {},
    ]
    params = [SamplingParams(temperature=1.0, **kw) for kw in kinds] * 2
    logits = torch.cat([peaked, flat])
    expected = filters_by_full_sort(logits, params)
    assert torch.equal(apply_filters(logits, params), expected)
    sizes = torch.isfinite(expected).sum(-1).tolist()
    assert sizes[2] == sizes[8] == 5 and sizes[5] == sizes[11] == 4096
    assert sizes[3] <= TOP_CANDIDATES < sizes[6]  # both paths taken
    defaults = [{"top_k": 50, "top_p": 0.95}] * 3  # the generation config's: only 50 ranked
    for kinds in ([{"top_k": 5}, {"top_k": 700}, {}], [{"top_p": 0.9}, {}], defaults):
        batch = [SamplingParams(temperature=1.0, **kw) for kw in kinds] * 4
        rows = logits[: len(batch)]
        assert torch.equal(apply_filters(rows, batch), filters_by_full_sort(rows, batch))


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"top_k": 5},
        {"top_k": 50, "top_p": 0.95},  # the generation config's
        {"top_k": GRAPH_CANDIDATES, "top_p": 0.9},
        {"min_p": 0.05},
        {"temperature": 1.7, "top_k": 100, "top_p": 0.999, "min_p": 0.01},
    ],
)
def test_the_graphs_draw_is_the_samplers_from_the_same_generator(kw):
    """Multi-step decoding draws in the compiled graph (`plain_draw`: GRAPH_CANDIDATES
    tokens ranked, no data-dependent branch) from noise its request's generator drew for
    all the steps at once; the sampler draws a step at a time. The same tokens, on peaked
    rows and on flat ones, and they are draws: they vary."""
    params = SamplingParams(**{"temperature": 0.8, **kw})
    assert params.graph_draw
    g, steps = gen(4), 6
    rows = torch.cat([torch.randn(3, 4096, generator=g) * 6, torch.randn(3, 4096, generator=g) * 0.3])
    drawn = set()
    for logits in rows[:, None]:
        knobs, top_k, noise = plain_draw_inputs(params, gen(9), steps, 4096, "cpu")
        in_graph = [int(plain_draw(logits, knobs, top_k, noise[j : j + 1])) for j in range(steps)]
        sampler = gen(9)
        assert in_graph == [sample(logits, [row(params, sampler)]).token_ids[0] for _ in range(steps)]
        drawn.update(in_graph)
    assert len(drawn) > 12


def test_a_batched_graph_draw_is_the_samplers_row_by_row():
    """The draw graph draws every row of a batch at once (`batch_draw_inputs`): seeded rows
    get the sampler's tokens from the same generators, greedy rows their argmax whatever
    their noise, and unseeded rows draws of their own."""
    g = gen(2)
    logits = torch.cat([torch.randn(3, 4096, generator=g) * 6, torch.randn(2, 4096, generator=g) * 0.3])
    params = [
        SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=1),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.7, min_p=0.01, seed=2),
        SamplingParams(temperature=1.2, top_k=GRAPH_CANDIDATES),  # unseeded
        SamplingParams(temperature=0.5, top_k=20, seed=3),
    ]
    assert all(p.graph_draw for p in params)
    drawn = set()
    for step in range(4):
        in_graph = [row(p, gen(10 * step + i) if i != 3 else None) for i, p in enumerate(params)]
        knobs, top_k, noise = batch_draw_inputs(in_graph, 4096, "cpu")
        assert knobs.shape == (5, 3) and top_k.shape == (5, 1) and noise.shape == (5, 4096)
        tokens = plain_draw(logits, knobs, top_k, noise).tolist()
        sampler = [row(p, gen(10 * step + i)) for i, p in enumerate(params)]
        want = [sample(logits[i : i + 1], [s]).token_ids[0] for i, s in enumerate(sampler)]
        assert tokens[:3] + tokens[4:] == want[:3] + want[4:] and tokens[1] == int(logits[1].argmax())
        assert tokens[3] in logits[3].topk(GRAPH_CANDIDATES).indices.tolist()
        drawn.update((tokens[0], tokens[3]))
    assert len(drawn) > 4


def test_a_graph_draws_only_what_its_candidates_hold():
    """top_p over the whole vocabulary, or a top_k past GRAPH_CANDIDATES, may need more
    tokens ranked than the graph ranks: the eager sampler draws those (and whatever else
    shapes or reports the logits)."""
    assert SamplingParams(temperature=0).graph_draw and SamplingParams(temperature=1.2, min_p=0.1).graph_draw
    assert SamplingParams(top_k=GRAPH_CANDIDATES, top_p=0.5).graph_draw
    for kw in (
        {"top_p": 0.9},
        {"top_k": GRAPH_CANDIDATES + 1},
        {"top_k": GRAPH_CANDIDATES + 1, "top_p": 0.9},
        {"top_k": 50, "logprobs": 2},
        {"top_k": 50, "presence_penalty": 0.5},
        {"logit_bias": {3: 1.0}},
        {"min_tokens": 2},
    ):
        assert not SamplingParams(**kw).graph_draw, kw


def test_a_vanishing_temperature_is_greedy_and_a_nan_row_still_keeps_a_token():
    """A temperature that is positive but tiny (2e-311, sent by a fuzzer) would overflow the
    logits; it is greedy, as in vLLM. And filters on a row of NaN logits keep one token
    rather than index out of the row (which stopped the engine loop)."""
    tiny = SamplingParams(temperature=2.2e-311, top_k=132, top_p=0.9)
    assert tiny.greedy and not SamplingParams(temperature=GREEDY_BELOW).greedy
    logits = torch.randn(2, 300, generator=gen(5))
    assert sample(logits, [row(tiny, gen(1))] * 2).token_ids == logits.argmax(-1).tolist()
    nan = torch.full((1, 300), math.nan)
    assert torch.isnan(apply_filters(nan, [SamplingParams(top_k=132, top_p=0.9)])).all()


def test_penalties_match_their_definition():
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, 0.0]])
    p = SamplingParams(repetition_penalty=1.5, presence_penalty=0.25, frequency_penalty=0.5)
    out = apply_penalties(logits, [row(p, prompt=[0], output=[1, 1, 3])])
    expected = torch.tensor(
        [
            [
                1.0 / 1.5,  # prompt token: repetition only
                -1.0 * 1.5 - 2 * 0.5 - 0.25,  # output twice
                2.0,  # unseen
                0.5 / 1.5 - 0.5 - 0.25,  # output once
                0.0,
            ]
        ]
    )
    torch.testing.assert_close(out, expected)
    assert torch.equal(apply_penalties(logits, [row(SamplingParams())]), logits)


def test_greedy_takes_penalties_into_account():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert sample(logits, [row(SamplingParams(temperature=0))]).token_ids == [0]
    p = SamplingParams(temperature=0, frequency_penalty=1.0)
    assert sample(logits, [row(p, output=[0])]).token_ids == [1]


def test_logprobs_are_raw_model_logprobs():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 0.0]])
    rows = [
        row(SamplingParams(temperature=0, logprobs=2, repetition_penalty=2.0), output=[1]),
        row(SamplingParams(temperature=0)),
    ]
    res = sample(logits, rows)
    ref = torch.log_softmax(logits[0], -1)
    assert res.token_ids == [2, 2]  # the penalty moved greedy off token 1 ...
    lp = res.logprobs[0]  # ... but logprobs describe the model's own distribution
    assert lp["token_id"] == 2 and lp["logprob"] == pytest.approx(ref[2].item())
    assert list(lp["top"]) == [1, 2] and lp["top"][1] == pytest.approx(ref[1].item())
    assert res.logprobs[1] is None
    zero = sample(logits[:1], [row(SamplingParams(temperature=0, logprobs=0))]).logprobs[0]
    assert zero["top"] == {} and zero["token_id"] == 1


@pytest.mark.parametrize("shape", [(3, 512), (40, 512), (40, 500)])
def test_fast_argmax_matches_torch_including_ties(shape):
    from lmops.runtime.engine.sampling import argmax

    x = torch.randint(0, 6, shape).float()  # many ties: the first maximum must win
    assert torch.equal(argmax(x), x.argmax(-1))
    y = torch.randn(shape)
    assert torch.equal(argmax(y), y.argmax(-1))
