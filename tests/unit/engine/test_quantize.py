"""int8 weight-only quantization: the numbers, the engine on the quantized model, the knobs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import lmops.runtime.quantize
from lmops.errors import LmopsError
from lmops.runtime.engine import LLMEngine, SamplingParams
from lmops.runtime.engine.config import EngineConfig
from lmops.runtime.model import Llama
from lmops.runtime.quantize import GEMM_ROWS, Int8Linear, Int8Weight, quantize

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


# Width 64 takes the CPU int8 kernel below GEMM_ROWS rows and the dequantizing GEMM from
# there on; width 60 (not a multiple of 16) the dequantizing GEMM at any row count.
@pytest.mark.parametrize("rows", [1, GEMM_ROWS - 1, GEMM_ROWS, 4 * GEMM_ROWS])
@pytest.mark.parametrize("width", [64, 60])
def test_int8_linear_is_close_to_float(width, rows):
    torch.manual_seed(0)
    w, x = torch.randn(96, width) * 0.05, torch.randn(rows, 1, width)
    qw = Int8Weight.from_float(w)
    assert qw.q.dtype == torch.int8 and qw.scale.shape == (96,)
    dequant = qw.q.float() * qw.scale.float()[:, None]
    # Per row: the error is half a step of that row's own scale (plus the scale's bf16 rounding).
    assert ((dequant - w).abs() <= 0.51 * qw.scale.float()[:, None] + 4e-3 * w.abs()).all()
    y, ref = F.linear(x, qw), x @ w.T
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert (y - ref).norm() / ref.norm() < 0.01


class _AtenOps(TorchDispatchMode):
    """Records the ATen ops that run under it."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("rows", "kernel"), [(1, True), (GEMM_ROWS - 1, True), (GEMM_ROWS, False)])
def test_int8_linear_takes_the_kernel_below_gemm_rows_and_a_gemm_from_there(rows, kernel):
    """The int8 kernel is a matrix-vector one (slower than float32 at many rows, see
    lmops.runtime.quantize): few rows go through it, more rows through one dequantized GEMM."""
    torch.manual_seed(0)
    qw, x = Int8Weight.from_float(torch.randn(32, 64)), torch.randn(rows, 64)
    with _AtenOps() as seen:
        F.linear(x, qw)
    assert ("_weight_int8pack_mm" in seen.ops) is kernel
    assert ("mm" in seen.ops) is not kernel


def test_quantize_replaces_every_linear_and_keeps_the_embedding(model_dir):
    model = quantize(Llama.from_pretrained(model_dir, "cpu", torch.float32), "int8")
    assert not [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert isinstance(model.lm_head, Int8Linear) and model.model.embed_tokens.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize(model, "int4")


@pytest.mark.parametrize("gemm_rows", [10**9, 0], ids=["kernel", "gemm"])
def test_int8_engine_matches_full_recompute_of_the_int8_model(
    model_dir, ref_model, prompts, greedy_reference, all_blocks_free, monkeypatch, gemm_rows
):
    """The engine's fused, paged path over int8 weights computes what the int8 model does,
    and greedy decoding stays close to the float model's (a sanity bound, not parity).
    One product path per run: the kernel and the GEMM round differently, and a full
    recompute's row count crosses GEMM_ROWS where the engine's decode steps do not."""
    monkeypatch.setattr(lmops.runtime.quantize, "GEMM_ROWS", gemm_rows)
    int8_ref = quantize(Llama.from_pretrained(model_dir, "cpu", torch.float32), "int8")
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", block_size=16, quantization="int8")
    assert isinstance(engine.model.lm_head, Int8Linear)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [greedy_reference(int8_ref, p, GREEDY.max_tokens) for p in prompts]
    all_blocks_free(engine)
    float_first = [greedy_reference(ref_model, p, 4) for p in prompts]
    same = sum(o.token_ids[:4] == f for o, f in zip(outs, float_first, strict=True))
    assert same >= 12, f"int8 greedy agrees with float32 on the first 4 tokens of {same}/16 prompts"


def test_unknown_quantization_is_a_clear_error(model_dir):
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")
    with pytest.raises(LmopsError, match="quantization must be one of"):
        LLMEngine.from_pretrained(model_dir, device="cpu", quantization="fp8")


def test_cli_generate_and_bench_take_quantization(model_dir):
    from lmops.pipeline import cli

    for command in (["generate", "--prompt", "x"], ["bench"]):
        args = cli.build_parser().parse_args([*command, "--model", str(model_dir), "--quantization", "int8"])
        engine = cli._engine(args, device="cpu", max_num_seqs=1)
        assert isinstance(engine.model.lm_head, Int8Linear)
    args = cli.build_parser().parse_args(["bench", "--model", str(model_dir)])
    assert not isinstance(cli._engine(args, device="cpu", max_num_seqs=1).model.lm_head, Int8Linear)
