"""The compiled decode path (engine/compiled.py): same greedy tokens as the eager path,
padded batches included, its small products and attention in lmops' kernels or inductor's
own code, and a clean fall back to eager where it does not apply."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from lmops.pipeline.random_model import random_model_dir
from lmops.runtime.engine import LLMEngine, SamplingParams, kernels
from lmops.runtime.engine import compiled as compiled_module
from lmops.runtime.engine import engine as engine_module
from lmops.runtime.engine import scheduler as scheduler_module
from lmops.runtime.engine.compiled import LOOKUP_MIN_MATCH, PREFILL_MIN_TOKENS
from lmops.runtime.engine.config import EngineConfig
from lmops.runtime.engine.forward import SMALL_PRODUCT_ROWS, linear, norm_linear
from lmops.runtime.engine.scheduler import ngram_draft
from lmops.runtime.model import rms_norm
from lmops.runtime.model_config import TINY_SHAPE
from tests.unit.engine.conftest import MAX_LEN, synthetic_corpus

GREEDY_FIELDS = {"temperature": 0, "max_tokens": 20, "ignore_eos": True}
GREEDY = SamplingParams(**GREEDY_FIELDS)


def test_lmops_compile_env_sets_the_default(monkeypatch):
    monkeypatch.setenv("LMOPS_COMPILE", "0")
    assert EngineConfig().compile is False
    monkeypatch.setenv("LMOPS_COMPILE", "1")
    assert EngineConfig().compile is True
    monkeypatch.delenv("LMOPS_COMPILE")
    assert EngineConfig().compile is True


@pytest.fixture(scope="module")
def compiled_engine(model_dir):
    """max_num_seqs 3: batch sizes 1, 2 and 4, so a 3-sequence step is padded. One step a
    call, so that a lone decode takes the size-1 graph too (multi-step's runs, on by default,
    have their own fixture: `multi_step_engine`). No drift sampling, in this module's
    engines: a request scoring its prompt prefills eagerly, and the tests count the sampler's
    calls (`test_a_prompt_that_is_not_fresh_or_alone_prefills_eagerly` has one)."""
    return LLMEngine.from_pretrained(
        model_dir, device="cpu", max_num_seqs=3, compile=True, num_scheduler_steps=1, drift_sample=0
    )


def test_compiled_greedy_matches_eager(model_dir, compiled_engine, prompts, all_blocks_free):
    engine = compiled_engine
    assert engine.runner.decode is not None and engine.runner.decode.sizes == [1, 2, 4]
    served = []
    run = engine.runner.decode.run
    engine.runner.decode.run = lambda seqs, num_new: served.append(r := run(seqs, num_new)) or r
    eager = LLMEngine.from_pretrained(model_dir, device="cpu", max_num_seqs=3, compile=False)
    assert eager.runner.decode is None
    # Alone, then 5 mixed-length prompts 3 at a time: prefills and mixed steps run eagerly,
    # pure decode steps of 1, 2 and 3 (padded to 4) sequences through the graphs.
    for batch in ([prompts[3]], prompts[4:9]):
        got = [o.token_ids for o in engine.generate(batch, GREEDY)]
        assert got == [o.token_ids for o in eager.generate(batch, GREEDY)]
    sizes = {len(r[0]) for r in served if r is not None}
    assert sizes == {1, 2, 3}
    all_blocks_free(engine)


def test_padding_rows_leave_the_managed_blocks_alone(compiled_engine, prompts):
    """Padding rows write only into the scratch block, which the block manager never hands out."""
    engine = compiled_engine
    scratch = engine.runner.decode.scratch_block
    assert scratch == engine.block_manager.num_blocks == engine.pool.num_blocks - 1
    before = engine.pool.kv[:, :, :scratch].clone()
    with torch.inference_mode():  # as the runner calls it (another mode would recompile)
        engine.runner.decode._run([], engine.runner.decode._steps[4, 1], 4, 1)
    assert torch.equal(engine.pool.kv[:, :, :scratch], before)


def test_compile_failure_falls_back_to_eager(model_dir, prompts, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(compiled_module.torch, "compile", broken)
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", max_num_seqs=2, compile=True)
    assert engine.runner.decode is None
    assert "decoding eagerly: no C++ compiler" in caplog.text
    assert len(engine.generate([prompts[2]], GREEDY)[0].token_ids) == GREEDY.max_tokens


def test_a_compile_failure_after_packing_drops_the_packed_weights(model_dir, monkeypatch, caplog):
    """The kernels loaded and the weights packed for them, then a graph fails to compile: the
    engine decodes eagerly and keeps no packed copy nobody reads (nor counts one)."""
    packed = []

    def broken(self, *args, **kwargs):
        packed.append(len(self.forward.packed_tensors()))
        raise RuntimeError("out of disk")

    monkeypatch.setattr(compiled_module.CompiledDecode, "_load_or_compile", broken)
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", max_num_seqs=2, compile=True)
    assert engine.runner.decode is None and "decoding eagerly: out of disk" in caplog.text
    if not kernels.kernels_loaded():
        pytest.skip("no AVX2 and FMA: nothing was packed")
    assert packed == [4 * engine.model.config.n_layer + 1]  # the failure came after packing
    assert engine.runner.forward.packed_tensors() == []
    state = sum(t.nbytes for t in engine.model.state_dict().values())
    assert engine.memory_bytes == state + engine.pool.nbytes


def test_two_compiled_engines_keep_their_own_weights(compiled_engine, prompts, tmp_path):
    """An engine loads the graphs an engine of the same structure compiled and calls them
    with no guard checks (compiled.py): its steps must read its own weights, not the first
    one's: another model of the same structure (its products' weights packed for lmops'
    kernel where it is built), whose final norm is also changed in place after it starts
    (read as it is at each call)."""
    other_dir = random_model_dir(
        tmp_path, synthetic_corpus(), 512, MAX_LEN, seed=1, init_std=0.15, **TINY_SHAPE
    )
    pool = compiled_engine.pool  # the same size (the graphs' key has it): its blocks but the scratch one
    other = LLMEngine.from_pretrained(
        other_dir,
        device="cpu",
        max_num_seqs=3,
        compile=True,
        num_scheduler_steps=1,
        kv_cache_memory=pool.nbytes - pool.nbytes // pool.num_blocks,
    )
    assert other.runner.decode.graphs_compiled == 0  # all loaded
    batch = prompts[10:13]
    for change in ("weights", "norm"):
        if change == "norm":
            with torch.no_grad():
                other.model.model.norm.weight.mul_(-1)  # argmax becomes argmin: other tokens
        got = [o.token_ids for o in other.generate(batch, GREEDY)]
        decode, other.runner.decode = other.runner.decode, None
        assert got == [o.token_ids for o in other.generate(batch, GREEDY)]
        other.runner.decode = decode
        assert got != [o.token_ids for o in compiled_engine.generate(batch, GREEDY)]


def test_the_kernels_read_packed_copies_of_the_float_weights(compiled_engine):
    """Where lmops' kernels are built, the graphs' few-row products read every float32 weight
    packed for the kernel (the LM head's too), a copy `memory_bytes` counts."""
    forward = compiled_engine.runner.forward
    if not kernels.kernels_loaded():
        assert forward.packed_tensors() == []
        pytest.skip("no AVX2 and FMA: no kernel")
    products = [(qkv, o, gu, down) for _, qkv, o, _, gu, down in forward.layers]
    products.append((compiled_engine.model.lm_head.weight,))
    for weights, packed in zip(products, [*forward.packed, (forward.packed_head,)], strict=True):
        for w, p in zip(weights, packed, strict=True):
            assert torch.equal(p, kernels.pack_weight(w)) and p.data_ptr() != w.data_ptr()
    assert len(forward.packed_tensors()) == 4 * len(forward.layers) + 1
    state = sum(t.nbytes for t in compiled_engine.model.state_dict().values())
    packed = sum(t.nbytes for t in forward.packed_tensors())
    assert compiled_engine.memory_bytes == state + packed + compiled_engine.pool.nbytes


def test_lmops_compile_env_rejects_other_values(monkeypatch):
    monkeypatch.setenv("LMOPS_COMPILE", "maybe")
    with pytest.raises(ValueError, match="LMOPS_COMPILE must be one of"):
        EngineConfig()


def test_compiled_int8_matches_eager_int8(model_dir, prompts):
    """The quantized weights (lmops.runtime.quantize) trace into the graph like float ones.
    (One step a call: two sequences never take a run, so its graphs are not compiled.)"""
    engines = [
        LLMEngine.from_pretrained(
            model_dir, device="cpu", max_num_seqs=2, quantization="int8", compile=c, num_scheduler_steps=1
        )
        for c in (True, False)
    ]
    assert engines[0].runner.decode is not None
    assert engines[0].runner.forward.packed_tensors() == []  # nothing packed for lmops' float32 kernel
    batch = prompts[5:7]
    compiled, eager = ([o.token_ids for o in e.generate(batch, GREEDY)] for e in engines)
    assert compiled == eager


def test_compiled_graphs_are_cached_on_disk(model_dir, prompts, monkeypatch, tmp_path, caplog):
    """A second engine loads the first one's graphs without compiling; an unreadable cache
    file is compiled afresh (with a warning) and replaced. Everything is under
    TORCHINDUCTOR_CACHE_DIR, so a cache shared by pods serves a new one whole. (One step a
    call, two graphs compiled afresh: a run's graph loads from disk in `multi_step_engine`,
    and in the image test's second container.)"""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    one_step = {"device": "cpu", "max_num_seqs": 1, "compile": True, "num_scheduler_steps": 1}
    first = LLMEngine.from_pretrained(model_dir, **one_step)
    assert len(list((tmp_path / "lmops-decode").glob("*-b1.bin"))) == 1
    draw = next((tmp_path / "lmops-decode").glob("*-draw.bin"))
    graphs = len(list((tmp_path / "lmops-decode").glob("*.bin")))
    assert first.runner.decode.graphs_compiled == graphs
    # inductor's precompiled headers sit beside them (a new container's /tmp has none)
    assert list((tmp_path / "precompiled_headers").glob("*.h.gch"))
    batch = [prompts[3]]
    expected = [o.token_ids for o in first.generate(batch, GREEDY)]

    real_compile = compiled_module.torch.compile

    class NoCompile:
        def __init__(self, *args, **kwargs):
            pass

        def aot_compile(self, *args):
            raise AssertionError("compiled although the graph was cached")

    monkeypatch.setattr(compiled_module.torch, "compile", NoCompile)
    monkeypatch.setattr(compiled_module, "_LOADED", {})  # what this process loaded before
    with caplog.at_level(logging.INFO, logger=compiled_module.log.name):
        second = LLMEngine.from_pretrained(model_dir, **one_step)
    assert second.runner.decode.graphs_compiled == 0
    assert f"({graphs} graphs: {graphs} loaded from the cache, 0 compiled)" in caplog.text
    assert [o.token_ids for o in second.generate(batch, GREEDY)] == expected
    # A loaded graph is loaded once per process (each load keeps its code for good): a
    # new version of the model, swapped in, calls the same one.
    swapped_in = LLMEngine.from_pretrained(model_dir, **one_step)
    assert swapped_in.runner.decode._steps[1, 1] is second.runner.decode._steps[1, 1]
    assert first.runner.decode._steps[1, 1] is not second.runner.decode._steps[1, 1]

    monkeypatch.setattr(compiled_module.torch, "compile", real_compile)
    monkeypatch.setattr(compiled_module, "_LOADED", {})
    draw.write_bytes(b"not a graph")  # the quickest graph to compile again
    third = LLMEngine.from_pretrained(model_dir, **one_step)
    assert "ignoring unreadable cache" in caplog.text
    assert third.runner.decode.graphs_compiled == 1
    assert [o.token_ids for o in third.generate(batch, GREEDY)] == expected
    assert draw.stat().st_size > 1000


def test_cache_key_follows_the_graphs_structure(model_dir, monkeypatch):
    """Saved graphs run unguarded, so anything traced into them must change the key:
    quantized weights, another KV block size, another thread count (inductor writes it
    into the generated loops), whether the graphs call lmops' kernels (a graph that calls
    them cannot run where they were not built)."""
    keys = set()
    for overrides in ({}, {"quantization": "int8"}, {"block_size": 8}):
        engine = LLMEngine.from_pretrained(model_dir, device="cpu", compile=False, **overrides)
        keys.add(compiled_module._structure_key(engine.runner.forward, engine.pool))
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        keys.add(compiled_module._structure_key(engine.runner.forward, engine.pool))
    finally:
        torch.set_num_threads(threads)
    loaded = kernels.kernels_loaded()
    monkeypatch.setattr(kernels, "_loaded", not loaded)
    keys.add(compiled_module._structure_key(engine.runner.forward, engine.pool))
    assert len(keys) == 5


def test_plain_greedy_decodes_take_the_graphs_argmax(compiled_engine, prompts, monkeypatch):
    """A compiled decode step of plain greedy rows uses the graph's argmax, not the sampler;
    a row that asks for log-probs still goes through the sampler, to the same tokens."""
    calls = []
    real = engine_module.sample
    monkeypatch.setattr(
        engine_module, "sample", lambda logits, *a: calls.append(len(logits)) or real(logits, *a)
    )
    compiled_engine.reset_prefix_cache()  # a fresh prompt (an earlier test ran this one)
    plain = compiled_engine.generate([prompts[3]], GREEDY)[0]
    assert calls == []  # the prefill's token too: the prefill graph's argmax
    with_logprobs = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
    assert compiled_engine.generate([prompts[3]], with_logprobs)[0].token_ids == plain.token_ids
    assert len(calls) == GREEDY.max_tokens


def test_sampled_decodes_draw_in_the_graph(model_dir, compiled_engine, prompts, monkeypatch):
    """Sampled requests' decode steps draw their tokens in the graphs, alone and batched
    (padded, and beside a greedy request), from noise their generators draw as the sampler
    would: seeded requests get the eager engine's tokens, and the sampler runs for the
    prefills only. A top_p over the whole vocabulary needs the sampler: a step with such a
    request goes through the sampler for every row, to the eager engine's tokens too."""
    calls = []
    real = engine_module.sample
    monkeypatch.setattr(
        engine_module, "sample", lambda logits, *a: calls.append(len(logits)) or real(logits, *a)
    )
    eager = LLMEngine.from_pretrained(model_dir, device="cpu", max_num_seqs=3, compile=False)
    served = served_by_graphs(compiled_engine)
    fields = {"seed": 5, "max_tokens": 20, "ignore_eos": True}
    drawn = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, **fields)
    hot = SamplingParams(temperature=1.5, min_p=0.02, **{**fields, "seed": 6})
    top_p = SamplingParams(temperature=0.8, top_p=0.95, **fields)
    assert not top_p.graph_draw
    for requests, in_graph in (
        ([(prompts[7], drawn)], True),
        ([(prompts[7], drawn), (prompts[8], hot), (prompts[2], GREEDY)], True),
        ([(prompts[7], drawn), (prompts[8], top_p)], False),
    ):
        batch, params = ([r[i] for r in requests] for i in (0, 1))
        want = [o.token_ids for o in eager.generate(batch, params)]
        calls.clear()
        assert [o.token_ids for o in compiled_engine.generate(batch, params)] == want
        assert len(set(want[0])) > 5  # drawn: not one token repeated
        assert (len(calls) < 5) is in_graph, calls  # prefills only, or every step
    assert {n for n, _ in served} == {1, 2, 3}


@pytest.fixture(scope="module")
def speculative_engine(model_dir):
    """Drafts of up to 4 tokens: verification graphs of 5 tokens a sequence for 1 and 2
    sequences (at most 16 rows), plain decode graphs for 1, 2 and 4, and (multi-step, on by
    default) a lone greedy sequence's lookup runs, which draft and verify in the graph."""
    engine = LLMEngine.from_pretrained(
        model_dir, device="cpu", max_num_seqs=3, compile=True, num_speculative_tokens=4, drift_sample=0
    )
    assert engine.runner.lookup_tokens == engine.scheduler.lookup_tokens == 8 * 5
    return engine


@pytest.fixture(scope="module")
def one_step_speculative_engine(model_dir, speculative_engine):
    """The speculative engine one step a call: every draft comes from the scheduler and is
    verified by the graphs of 5 tokens a sequence (loaded from the speculative engine's)."""
    engine = LLMEngine.from_pretrained(
        model_dir,
        device="cpu",
        max_num_seqs=3,
        compile=True,
        num_speculative_tokens=4,
        num_scheduler_steps=1,
        drift_sample=0,
    )
    assert engine.runner.decode.graphs_compiled == 0 and not engine.runner.lookup_tokens
    return engine


def served_by_graphs(engine) -> list[tuple[int, int]]:
    """(sequences, most new tokens of one) of each decode step the compiled graphs serve from
    now on (prefills: `prefilled_by_graph`)."""
    served = []
    run = engine.runner.decode.run

    def spy(seqs, num_new):
        decoding = all(s.num_computed_tokens == s.num_tokens - 1 for s in seqs)
        out = run(seqs, num_new)
        if out is not None and decoding:
            served.append((len(seqs), max(num_new)))
        return out

    engine.runner.decode.run = spy
    return served


def prefilled_by_graph(engine) -> list[int]:
    """The length of each prompt chunk the prefill graph serves from now on."""
    served = []
    run = engine.runner.decode._prefill_run
    engine.runner.decode._prefill_run = lambda seqs, num_new: (
        (r := run(seqs, num_new)) is not None and served.append(num_new[0]) or r
    )
    return served


def test_drafts_are_verified_by_the_compiled_graph_with_greedys_output(
    model_dir, one_step_speculative_engine, prompts
):
    """Echoed prompts (prompt lookup finds drafts, some right and some wrong), alone and two
    at a time, one of them sampled (its rows go through the sampler, not the argmax): the
    greedy ones' tokens are eager non-speculative greedy's, the verification steps run
    through the graphs, and the rejected drafts roll back."""
    engine = one_step_speculative_engine
    assert engine.runner.decode.verify_sizes == [1, 2] and engine.runner.decode.verify_len == 5
    served = served_by_graphs(engine)
    eager = LLMEngine.from_pretrained(model_dir, device="cpu", max_num_seqs=3, compile=False)
    echoed = [prompts[i] + prompts[i] for i in (2, 5)]
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)
    want = [o.token_ids for o in eager.generate(echoed, GREEDY)]
    assert [engine.generate([p], GREEDY)[0].token_ids for p in echoed] == want
    got = engine.generate(echoed, [GREEDY, seeded])
    assert got[0].token_ids == want[0] and len(got[1].token_ids) == 20
    assert {(1, 5), (2, 5)} <= set(served)  # drafting steps of one and of two sequences
    value = engine.metrics.registry.get_sample_value
    accepted = value("lmops:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted < value("lmops:spec_decode_num_draft_tokens_total")


def test_right_drafts_are_kept_in_five_graph_calls(
    model_dir, one_step_speculative_engine, prompts, monkeypatch
):
    """Drafts that greedy decoding would produce, of 4 tokens, then of 3 (padded rows): each
    step after the prefill is one graph call and takes the graph's argmax, 5 calls for the
    19 tokens after the first."""
    engine, prompt = one_step_speculative_engine, prompts[9]
    want = (
        LLMEngine.from_pretrained(model_dir, device="cpu", compile=False)
        .generate([prompt], GREEDY)[0]
        .token_ids
    )

    def propose(token_ids, k):
        done = len(token_ids) - len(prompt)
        return want[done:][: min(k, 4 if done < 10 else 3)]

    monkeypatch.setattr(scheduler_module, "ngram_draft", propose)
    served = served_by_graphs(engine)
    calls = []
    real = engine_module.sample
    monkeypatch.setattr(
        engine_module, "sample", lambda logits, *a: calls.append(len(logits)) or real(logits, *a)
    )
    assert engine.generate([prompt], GREEDY)[0].token_ids == want
    assert calls == []  # the prefill's token and every verification's: the graphs' argmax
    # 1 (the prefill) + 5 + 5 + 4 + 4 + 1: the last token has no room for a draft
    assert [n for _, n in served] == [5, 5, 4, 4, 1]


@pytest.mark.parametrize("echoed", [True, False], ids=["echoed", "plain"])
def test_lookup_runs_draft_and_verify_in_the_graph(
    speculative_engine, eager_engine, prompts, echoed, monkeypatch
):
    """A lone greedy request with prompt lookup, multi-step: after the prefill its 39 tokens
    come from one graph call, which drafted, verified and kept greedy's tokens by itself
    (the scheduler drafted nothing, the sampler never ran), to eager greedy's
    tokens; on an echoed prompt it kept drafts (counted in /metrics), and fewer than it
    drafted; it drafted only after a match of 2 tokens or more."""
    engine = speculative_engine
    prompt = prompts[4] + prompts[4] if echoed else prompts[7]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = eager_engine.generate([prompt], params)[0].token_ids
    value = engine.metrics.registry.get_sample_value
    drafted, kept = (value(f"lmops:spec_decode_num_{x}_tokens_total") for x in ("draft", "accepted"))
    monkeypatch.setattr(scheduler_module, "ngram_draft", lambda *a: pytest.fail("drafted by the scheduler"))
    calls = []
    real = engine_module.sample
    monkeypatch.setattr(
        engine_module, "sample", lambda logits, *a: calls.append(len(logits)) or real(logits, *a)
    )
    served = served_by_graphs(engine)
    assert engine.generate([prompt], params)[0].token_ids == want
    assert served == [(1, 39)] and calls == []
    drafted, kept = (
        value("lmops:spec_decode_num_draft_tokens_total") - drafted,
        value("lmops:spec_decode_num_accepted_tokens_total") - kept,
    )
    if echoed:
        assert 0 < kept < drafted
    # A pass drafts only where the tokens so far end in a match of LOOKUP_MIN_MATCH tokens or
    # more (elsewhere it is a plain one-row step): K tokens at most at each such position.
    tokens = prompt + want
    drafting = [
        m for m in range(len(prompt) + 1, len(tokens)) if ngram_draft(tokens[:m], 4, min_n=LOOKUP_MIN_MATCH)
    ]
    assert drafted <= 4 * len(drafting)


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 13, 60])
def test_lookup_runs_stop_where_greedy_stops(
    speculative_engine, eager_engine, prompts, max_tokens, all_blocks_free
):
    """A stop token, a stop string or EOS inside a lookup run ends the output there, any
    max_tokens is met exactly, and a run that reaches the model's context (its drafts'
    positions past it) keeps greedy's tokens up to the end."""
    prompt = prompts[4] + prompts[4]
    want = eager_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    stop_token = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[want.token_ids[6]])
    stop_text = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[want.text[-12:-8]])
    to_the_end = SamplingParams(temperature=0, max_tokens=MAX_LEN, ignore_eos=True)
    long_prompt = (prompt * 8)[: MAX_LEN - max_tokens]
    for p, params in (
        (prompt, stop_token),
        (prompt, stop_text),
        (prompt, SamplingParams(temperature=0, max_tokens=max_tokens)),
        (long_prompt, to_the_end),
    ):
        got, ref = speculative_engine.generate([p], params)[0], eager_engine.generate([p], params)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
    all_blocks_free(speculative_engine)


@pytest.fixture(scope="module")
def multi_step_engine(model_dir):
    """Multi-step decoding as it is by default, 8 steps a graph call, beside the plain decode
    graphs (the runs' graphs are those of the module's other default engines)."""
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", max_num_seqs=3, compile=True, drift_sample=0)
    assert engine.runner.scheduler_steps == 8
    return engine


@pytest.fixture(scope="module")
def eager_engine(model_dir):
    return LLMEngine.from_pretrained(model_dir, device="cpu", max_num_seqs=3, compile=False)


def test_multi_step_makes_greedys_tokens_eight_a_graph_call(
    multi_step_engine, eager_engine, prompts, monkeypatch, all_blocks_free
):
    """A lone greedy request: each step after the prefill runs 8 decode steps in one graph
    call, each step's argmax the next one's input, to eager one-step greedy's tokens; the
    last 3 tokens, fewer than a run of 8, in one call of the same graph (its loop runs any
    count up to 8). No sampler: the prefill's token is its graph's argmax."""
    engine = multi_step_engine
    wants = [eager_engine.generate([p], GREEDY)[0].token_ids for p in (prompts[2], prompts[9])]
    served = served_by_graphs(engine)
    value = engine.metrics.registry.get_sample_value
    tokens_before = value("lmops:generation_tokens_total")
    calls = []
    real = engine_module.sample
    monkeypatch.setattr(
        engine_module, "sample", lambda logits, *a: calls.append(len(logits)) or real(logits, *a)
    )
    for prompt, want in zip((prompts[2], prompts[9]), wants, strict=True):
        served.clear()
        assert engine.generate([prompt], GREEDY)[0].token_ids == want
        # 1 (the prefill) + 2 x 8 + 3 = 20 tokens
        assert [n for _, n in served] == [8, 8, 3]
    assert calls == []
    assert value("lmops:generation_tokens_total") - tokens_before == 2 * GREEDY.max_tokens
    all_blocks_free(engine)


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 8, 13])
def test_multi_step_stops_where_one_step_greedy_stops(
    multi_step_engine, eager_engine, prompts, max_tokens, all_blocks_free
):
    """A stop token, a stop string or EOS inside a run of steps ends the output there (the
    run's later tokens are dropped and their blocks freed), as one-step greedy ends it; and
    any max_tokens is met exactly."""
    prompt = prompts[5]
    want = eager_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    stop_token = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[want.token_ids[6]])
    stop_text = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[want.text[-12:-8]])
    for params in (stop_token, stop_text, SamplingParams(temperature=0, max_tokens=max_tokens)):
        got, ref = multi_step_engine.generate([prompt], params)[0], eager_engine.generate([prompt], params)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
    all_blocks_free(multi_step_engine)


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.8, "top_k": 50, "top_p": 0.95},  # the generation config's
        {"temperature": 1.0, "top_k": 20, "top_p": 0.9},
        {"temperature": 1.3, "min_p": 0.02},
    ],
)
def test_multi_step_draws_a_sampled_requests_tokens_in_the_graph(
    multi_step_engine, eager_engine, prompts, monkeypatch, sampling, all_blocks_free
):
    """A lone plain sampled request runs multi-step too, its draws made in the graph from
    noise its generator drew for the run: a seeded request gets the tokens the eager
    sampler draws one step at a time, and the sampler runs for the prefill only (the last
    3 tokens in one shorter run)."""
    engine = multi_step_engine
    served = served_by_graphs(engine)
    calls = []
    real = engine_module.sample
    monkeypatch.setattr(
        engine_module, "sample", lambda logits, *a: calls.append(len(logits)) or real(logits, *a)
    )
    params = SamplingParams(**sampling, seed=3, max_tokens=20, ignore_eos=True)
    want = eager_engine.generate([prompts[6]], params)[0].token_ids
    calls.clear()
    assert engine.generate([prompts[6]], params)[0].token_ids == want
    assert len(set(want)) > 5  # drawn: not one token repeated
    assert [n for _, n in served] == [8, 8, 3] and calls == [1]
    all_blocks_free(engine)


def test_multi_step_only_for_a_lone_plain_request(multi_step_engine, eager_engine, prompts):
    """Two requests at once, and requests whose draw needs the eager sampler (log-probs,
    penalties, a logit bias, min_tokens, top_p over the whole vocabulary) decode one step at
    a time (a newcomer would wait for a whole run; the sampler runs between steps), to the
    same tokens as without multi-step."""
    engine = multi_step_engine
    served = served_by_graphs(engine)
    two = [o.token_ids for o in engine.generate(prompts[3:5], GREEDY)]
    assert two == [o.token_ids for o in eager_engine.generate(prompts[3:5], GREEDY)]
    seeded = {"temperature": 0.8, "seed": 3, "max_tokens": 20, "ignore_eos": True}
    for extra in ({"logprobs": 1}, {"presence_penalty": 0.5}, {"logit_bias": {7: 3.0}}, {"min_tokens": 5}):
        for params in (SamplingParams(**GREEDY_FIELDS, **extra), SamplingParams(**seeded, **extra)):
            assert not params.graph_draw
            got = engine.generate([prompts[6]], params)[0]
            assert got.token_ids == eager_engine.generate([prompts[6]], params)[0].token_ids
    top_p = SamplingParams(**seeded, top_p=0.9)
    assert (
        engine.generate([prompts[6]], top_p)[0].token_ids
        == eager_engine.generate([prompts[6]], top_p)[0].token_ids
    )
    assert served and all(n == 1 for _, n in served)


def test_multi_step_is_a_compiled_path_only(model_dir, prompts):
    """Without compiled decode (LMOPS_COMPILE=0, CUDA) the setting has no graph to run: one
    step at a time."""
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", compile=False, num_scheduler_steps=4)
    assert engine.runner.scheduler_steps == 1 and engine.scheduler.num_scheduler_steps == 1
    assert len(engine.generate([prompts[2]], GREEDY)[0].token_ids) == GREEDY.max_tokens
    with pytest.raises(ValueError, match="num_scheduler_steps must be an integer >= 1, got 0"):
        EngineConfig(num_scheduler_steps=0)


def test_a_fresh_prompt_prefills_in_one_graph_call(
    multi_step_engine, eager_engine, prompts, monkeypatch, all_blocks_free
):
    """A lone fresh prompt of PREFILL_MIN_TOKENS tokens or more prefills in one call of the
    prefill graph, one graph for every length: its argmax is the first token (no sampler
    call), its logits are eager's (the first token's log-probs), and the K/V it wrote are
    (the decode graphs that read them make eager greedy's tokens)."""
    engine = multi_step_engine
    batch = [prompts[11][:PREFILL_MIN_TOKENS], prompts[2], prompts[9], (prompts[13] * 3)[: MAX_LEN - 20]]
    wants = [eager_engine.generate([p], GREEDY)[0].token_ids for p in batch]
    calls = []
    real = engine_module.sample
    monkeypatch.setattr(
        engine_module, "sample", lambda logits, *a: calls.append(len(logits)) or real(logits, *a)
    )
    prefilled = prefilled_by_graph(engine)
    for prompt, want in zip(batch, wants, strict=True):
        engine.reset_prefix_cache()  # fresh: earlier tests' blocks are cached
        assert engine.generate([prompt], GREEDY)[0].token_ids == want
    assert prefilled == [len(p) for p in batch] and calls == []
    first = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    engine.reset_prefix_cache()
    got = engine.generate([prompts[9]], first)[0].outputs[0].logprobs[0]
    want = eager_engine.generate([prompts[9]], first)[0].outputs[0].logprobs[0]
    assert got["token_id"] == want["token_id"] and got["top"].keys() == want["top"].keys()
    assert got["top"] == pytest.approx(want["top"], abs=1e-4)
    assert prefilled[-1] == len(prompts[9])
    all_blocks_free(engine)


def test_a_prompt_that_is_not_fresh_or_alone_prefills_eagerly(
    model_dir, multi_step_engine, eager_engine, prompts
):
    """The prefill graph serves a lone fresh prompt's chunk of PREFILL_MIN_TOKENS tokens or
    more that does not score its prompt, and nothing else: a shorter prompt, the rest of a
    prompt after a prefix cache hit, two prompts at once and a prompt asking for its own
    log-probs (every row's logits) prefill eagerly; a chunked prompt's first chunk takes the
    graph (and no token: the prompt goes on), its later ones eager. Each to the eager
    engine's tokens. (A request scoring its prompt for the drift signal is `scoring` as one
    asking for prompt log-probs is.)"""
    engine = multi_step_engine
    engine.reset_prefix_cache()
    prefilled = prefilled_by_graph(engine)
    shared = prompts[9][:32] + prompts[11][:40]  # after prompts[9]: its first 2 blocks cached
    scored = SamplingParams(**GREEDY_FIELDS, prompt_logprobs=1)
    for batch, params in (
        ([prompts[9][: PREFILL_MIN_TOKENS - 1]], GREEDY),
        ([prompts[9]], GREEDY),
        ([shared], GREEDY),
        (prompts[12:14], GREEDY),
        ([prompts[14]], scored),
    ):
        got = engine.generate(batch, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in eager_engine.generate(batch, params)]
    assert prefilled == [len(prompts[9])]
    chunked = LLMEngine.from_pretrained(
        model_dir, device="cpu", max_num_seqs=3, compile=True, max_num_batched_tokens=32, drift_sample=0
    )
    assert chunked.runner.decode.graphs_compiled == 0
    prefilled = prefilled_by_graph(chunked)
    want = eager_engine.generate([prompts[13]], GREEDY)[0].token_ids
    assert chunked.generate([prompts[13]], GREEDY)[0].token_ids == want
    assert prefilled == [32]  # prompts[13]'s 108 tokens: 32 in the graph, then 32, 32 and 12


@pytest.mark.parametrize("kernel", [True, False], ids=["lmops-kernel", "inductor-loop"])
@pytest.mark.parametrize("rows", [1, 5, SMALL_PRODUCT_ROWS])
def test_compiled_small_products_are_our_own(rows, kernel, tmp_path):
    """Below SMALL_PRODUCT_ROWS rows a compiled projection is lmops' kernel where its weight
    is packed for it (the kernels built), else inductor's own loop, never an aten.mm call
    (MKL's generic code on AMD CPUs), and it equals F.linear; so does the normed one, which
    scales the outputs by 1/rms instead of the inputs."""
    from torch._inductor.utils import run_and_get_code

    if kernel and not kernels.load_kernels(tmp_path, "test"):
        pytest.skip("no AVX2 and FMA: no kernel")
    x, w, g = torch.randn(rows, 192), torch.randn(320, 192), torch.rand(192) + 0.5
    packed = kernels.pack_weight(w) if kernel else None
    out, code = run_and_get_code(torch.compile(linear, fullgraph=True, dynamic=False), x, w, packed)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-4)
    code = "".join(code)
    assert ("extern_kernels.mm(" in code) == (rows >= SMALL_PRODUCT_ROWS)
    assert ("torch.ops.lmops.small_linear" in code) == (kernel and rows < SMALL_PRODUCT_ROWS)
    normed = torch.compile(norm_linear, fullgraph=True, dynamic=False)(x, g, w, 1e-5, packed)
    torch.testing.assert_close(normed, F.linear(rms_norm(x, g, 1e-5), w), rtol=1e-5, atol=1e-4)
