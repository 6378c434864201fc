"""The same engine code on CUDA: float32 parity with the CPU reference, bfloat16 sanity.
Skipped where no GPU is present."""

from __future__ import annotations

import pytest
import torch

from lmops.runtime.engine import LLMEngine, SamplingParams
from lmops.runtime.model import KVCache, Llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_float32_greedy_matches_cpu_full_recompute(model_dir, ref_model, prompts, greedy_reference):
    engine = LLMEngine.from_pretrained(model_dir, device="cuda", dtype="float32", max_num_batched_tokens=64)
    batch = prompts[::2]
    outs = engine.generate(batch, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in outs] == [greedy_reference(ref_model, p, 16) for p in batch]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_cuda_bfloat16_engine_tracks_the_contiguous_path(model_dir, prompts):
    engine = LLMEngine.from_pretrained(model_dir, device="cuda")
    assert engine.dtype == torch.bfloat16 and engine.pool.kv.dtype == torch.bfloat16
    rows = []
    execute = engine.runner.execute

    def spy(batch):
        output = execute(batch)
        rows.append(output.logits[0].clone())
        return output

    engine.runner.execute = spy
    p = prompts[9]
    out = engine.generate([p], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    ref = Llama.from_pretrained(model_dir, "cuda", torch.bfloat16)
    ids = p + out.token_ids
    cache = KVCache(ref.config, 1, len(ids), "cuda", torch.bfloat16)
    with torch.no_grad():
        logits = ref(torch.tensor([p], device="cuda"), cache=cache)[0][0, -1:]
        steps = [
            ref(
                torch.tensor([[t]], device="cuda"),
                positions=torch.tensor([[len(p) + i]], device="cuda"),
                cache=cache,
            )[0][0]
            for i, t in enumerate(out.token_ids[:-1])
        ]
    expected = torch.cat([logits] + steps).float()
    got = torch.stack(rows)
    assert got.shape == expected.shape
    # bf16 has 8 mantissa bits: agreement to a few hundredths, and the same greedy tokens.
    torch.testing.assert_close(got, expected, atol=0.1, rtol=0.02)
    assert got.argmax(-1).tolist() == out.token_ids
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=12)
    assert engine.generate([p], seeded)[0].token_ids == engine.generate([p], seeded)[0].token_ids
