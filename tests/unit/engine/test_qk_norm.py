"""Both layouts through the engine, Qwen3's (model.qk_norm, the default: what test_parity's
fixture is) and Llama's: the fused forward, the paged eager path, the compiled decode graph
and int8 all compute what model.py's network does, as test_parity, test_compiled and
test_quantize pin them for the default."""

from __future__ import annotations

import copy

import pytest
import torch

import lmops.runtime.quantize
from lmops.pipeline.random_model import random_model_dir
from lmops.runtime.engine import LLMEngine, SamplingParams
from lmops.runtime.engine.forward import FusedForward
from lmops.runtime.model import Llama
from lmops.runtime.model_config import TINY_SHAPE
from lmops.runtime.quantize import quantize
from tests.unit.engine.conftest import MAX_LEN, synthetic_corpus
from tests.unit.engine.test_parity import causal

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module", params=[True, False], ids=["qwen3", "llama"])
def layout_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"tiny-qk-norm-{request.param}")
    shape = {**TINY_SHAPE, "qk_norm": request.param}
    return random_model_dir(d, synthetic_corpus(), 512, MAX_LEN, seed=0, init_std=0.15, **shape)


@pytest.fixture(scope="module")
def layout(layout_dir):
    return Llama.from_pretrained(layout_dir, "cpu", torch.float32)


def test_the_layout_is_config_jsons_and_qk_norms_weights_matter(layout_dir, layout, prompts):
    """Guards the tests below: config.json names the layout, and with Qwen3's norm weights
    set to 1 the fused forward's logits change (so a norm applied to the wrong heads shows)."""
    qk_norm = layout.config.qk_norm
    name = "Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM"
    assert f'"{name}"' in (layout_dir / "config.json").read_text()
    plain = FusedForward(copy.deepcopy(layout))
    assert len(plain.qk_norms) == (layout.config.n_layer if qk_norm else 0)
    for table in plain.qk_norms:
        table.fill_(1.0)
    ids = torch.tensor(prompts[9])
    with torch.no_grad():
        got = plain.logits(plain(ids, torch.arange(len(ids)), causal))
        assert torch.allclose(got, layout(ids[None])[0][0], atol=1e-5) is not qk_norm


def test_fused_forward_is_the_models_forward(layout, prompts):
    fused = FusedForward(copy.deepcopy(layout))
    ids = torch.tensor(prompts[9])
    with torch.no_grad():
        got = fused.logits(fused(ids, torch.arange(len(ids)), causal))
        torch.testing.assert_close(got, layout(ids[None])[0][0], atol=1e-5, rtol=0)


def test_engine_greedy_matches_full_recompute(layout_dir, layout, prompts, greedy_reference, all_blocks_free):
    """Batched, paged, with prefix caching: every prompt's greedy tokens as the network's."""
    engine = LLMEngine.from_pretrained(layout_dir, device="cpu", block_size=16)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [greedy_reference(layout, p, GREEDY.max_tokens) for p in prompts]
    all_blocks_free(engine)


def test_compiled_and_int8_match_their_references(layout_dir, prompts, greedy_reference, monkeypatch):
    """The compiled decode graph (which traces forward.py) over int8 weights, one engine,
    against the int8 network's full recompute (through the int8 kernel alone, as
    test_quantize explains: the kernel and the GEMM round differently)."""
    monkeypatch.setattr(lmops.runtime.quantize, "GEMM_ROWS", 10**9)
    engine = LLMEngine.from_pretrained(
        layout_dir, device="cpu", max_num_seqs=2, quantization="int8", compile=True
    )
    assert engine.runner.decode is not None
    int8_ref = quantize(Llama.from_pretrained(layout_dir, "cpu", torch.float32), "int8")
    batch = prompts[5:7]
    outs = engine.generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == [greedy_reference(int8_ref, p, GREEDY.max_tokens) for p in batch]
