"""Streaming text: UTF-8-safe incremental detokenization, stop strings, deltas."""

from __future__ import annotations

import pytest

from lmops.runtime.engine import LLMEngine, SamplingParams
from lmops.runtime.engine.sequence import IncrementalDetokenizer, held_back

# Characters absent from the fixture corpus: byte-level BPE spells each with 2-4 byte tokens.
TEXT = "price: 5€, clef 𝄞 and ñ!"


def test_detokenizer_never_emits_half_a_character(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    assert len(ids) > len(TEXT.encode()) / 2  # multi-byte characters really span tokens
    det = IncrementalDetokenizer(tokenizer, tokenizer.encode("x = ", add_special_tokens=False).ids)
    deltas = [det.add(t) for t in ids]
    assert "".join(deltas) + det.flush() == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some tokens completed no character and were held back


def test_detokenizer_flushes_an_incomplete_character(tokenizer):
    ids = tokenizer.encode("a€", add_special_tokens=False).ids
    det = IncrementalDetokenizer(tokenizer, [])
    assert "".join(det.add(t) for t in ids[:-1]) == "a"
    assert det.flush() == "\ufffd"


def test_held_back_is_the_longest_tail_that_may_become_a_stop():
    assert held_back("hello wor", 0, ["world"]) == 3
    assert held_back("hello", 0, ["xyz"]) == 0
    assert held_back("ab", 0, ["b!", "ab!"]) == 2
    assert held_back("abc", 2, ["cde"]) == 1
    assert held_back("abc", 2, ["bcd"]) == 0  # never reaches back before `start`


def run_streaming(engine: LLMEngine, prompt, params):
    rid = engine.add_request(None, prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(o for o in engine.step() if o.request_id == rid)
    return outs


def test_deltas_add_up_and_cumulative_text_only_grows(model_dir, prompts):
    engine = LLMEngine.from_pretrained(model_dir, device="cpu")
    outs = run_streaming(engine, prompts[3], SamplingParams(temperature=0.8, seed=3, max_tokens=40))
    final = outs[-1].outputs[0]
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert "".join(o.outputs[0].delta_text for o in outs) == final.text
    assert sum((o.outputs[0].delta_token_ids for o in outs), []) == final.token_ids
    assert all(final.text.startswith(o.outputs[0].text) for o in outs)
    if final.finish_reason == "length":
        assert final.text == engine.tokenizer.decode(final.token_ids, skip_special_tokens=True)


def token_boundary_stop(tokenizer, ids: list[int]) -> tuple[str, int]:
    """A 4-char string straddling the boundary between two generated tokens, and its offset."""
    full = tokenizer.decode(ids)
    for i in range(len(ids) - 1):
        a = tokenizer.decode(ids[: i + 1])
        b = tokenizer.decode(ids[: i + 2])
        stop = b[len(a) - 2 : len(a) + 2]
        if (
            len(a) >= 2
            and len(b) - len(a) >= 2
            and full.startswith(b)
            and b.startswith(a)
            and "\ufffd" not in stop
            and full.count(stop) == 1
        ):
            return stop, len(a) - 2
    raise AssertionError("no usable token boundary in the greedy continuation")


@pytest.mark.parametrize("prompt_index", [2, 11])
def test_stop_string_across_token_boundary_is_never_emitted(model_dir, prompts, prompt_index):
    engine = LLMEngine.from_pretrained(model_dir, device="cpu")
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = engine.generate([prompts[prompt_index]], base)[0]
    stop, at = token_boundary_stop(engine.tokenizer, full.token_ids)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["@@never", stop])
    outs = run_streaming(engine, prompts[prompt_index], params)
    final = outs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == full.text[:at]
    streamed = ""
    for o in outs:
        streamed += o.outputs[0].delta_text
        assert stop[:3] not in streamed[at:], "part of the stop string was streamed"
    assert streamed == full.text[:at]
    # The token ids stop at the token that completed the stop string.
    assert full.token_ids[: len(final.token_ids)] == final.token_ids


def test_stop_token_ids_and_eos(model_dir, prompts):
    engine = LLMEngine.from_pretrained(model_dir, device="cpu")
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = engine.generate([prompts[7]], base)[0]
    target = full.token_ids[5]
    first = full.token_ids.index(target)
    out = engine.generate(
        [prompts[7]], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[target])
    )[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == target
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.text == engine.tokenizer.decode(full.token_ids[:first])  # the stop token's text is cut
    eos = LLMEngine(engine.model, engine.tokenizer, eos_token_ids=[target])
    out = eos.generate([prompts[7]], SamplingParams(temperature=0, max_tokens=30))[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[: first + 1]
    out = eos.generate([prompts[7]], base)[0]
    assert out.finish_reason == "length" and out.token_ids == full.token_ids
