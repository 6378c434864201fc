"""The engine's forward: the decoder over a packed batch, written once.

All sequences' new tokens of a step are one (T,) row with their own positions, so mixed
lengths never pad the projections or MLPs; attention, the one part that differs, is
passed in (`Attend`): runner.PagedAttention for the eager step (any mix of prefills and
decodes), compiled.DecodeAttention for the compiled decode graph, which traces this very
code. It is model.py's `Llama` restated for speed: Q/K/V and gate/up projections fused,
RoPE from a precomputed table, no nn.Module dispatch (at batch size 1 a decode step is
mostly per-op overhead, and this halves it). RMSNorm and the RoPE tables are model.py's own
functions; the rest is pinned to model.py by tests/unit/engine/test_parity.py.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from lmops.runtime.engine.kernels import pack_weight
from lmops.runtime.hugepages import move_to_huge_pages
from lmops.runtime.model import Llama, inv_rms, rms_norm, rope_cos_sin

# Below this many rows a compiled CPU graph computes its float32 projections itself (`linear`);
# from here on aten.mm's GEMM is as fast (the crossover: benchmarks/README.md, "The single-row
# products"). lmops' kernel on packed weights is ahead of aten.mm on the AVX2 EPYC at 16 and 24
# rows too, but unmeasured against MKL's AVX-512 code on an Intel CPU, so the line stays here
# (benchmarks/README.md, "The products' weights packed for the kernel").
SMALL_PRODUCT_ROWS = 16


class Attend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q: (T, H, D) rotated; kv: (T, 2 * Hkv, D), rotated K heads then V heads -> (T, H, D)."""
        ...


def causal_attention(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """A fresh prompt's attention, nothing cached before it: each token over the prompt's
    own keys up to itself (`Attend`'s q and kv -> (T, H, D)), by SDPA's flash kernel, which
    takes the grouped K/V heads as they are (`enable_gqa`)."""
    Hkv = kv.shape[1] // 2
    ks, vs = kv.transpose(0, 1)[None].split(Hkv, 1)
    y = F.scaled_dot_product_attention(q.transpose(0, 1)[None], ks, vs, is_causal=True, enable_gqa=True)
    return y[0].transpose(0, 1)


class FusedForward:
    """model.py's forward over a packed batch, with fused projections.

    The fused weights are built once, and the model's own q/k/v and gate/up parameters
    are re-pointed to views of them: no second copy of the weights, and model.py's
    forward (used by references and tests) keeps working on the same numbers. (Those
    views share storage, so save such a model with `.clone()`d tensors, not directly.) On
    CPU every tensor a step reads then moves onto huge pages (lmops.runtime.hugepages).
    A compiled CPU graph whose products go through lmops' kernel reads its float32 weights
    packed for it (`pack_for_kernels`), a second copy of them.
    """

    def __init__(self, model: Llama):
        cfg = model.config
        self.model = model
        self.n_head, self.n_kv, self.head_dim = cfg.n_head, cfg.n_kv_heads, cfg.head_dim
        self.inter, self.eps = cfg.intermediate_size, cfg.norm_eps
        self.layers = []
        # Qwen3's QK-norm, per layer: the q_norm weight for each query head and k_norm's for
        # each key head, one (H + Hkv, D) table, so one RMSNorm covers both.
        self.qk_norms = []
        with torch.no_grad():
            for layer in model.model.layers:
                a, mlp = layer.self_attn, layer.mlp
                qkv = _fuse(a.q_proj, a.k_proj, a.v_proj)
                gate_up = _fuse(mlp.gate_proj, mlp.up_proj)
                self.layers.append(
                    (
                        layer.input_layernorm.weight,
                        qkv,
                        a.o_proj.weight,
                        layer.post_attention_layernorm.weight,
                        gate_up,
                        mlp.down_proj.weight,
                    )
                )
                if cfg.qk_norm:
                    heads = (a.q_norm.weight.expand(self.n_head, -1), a.k_norm.weight.expand(self.n_kv, -1))
                    self.qk_norms.append(torch.cat(heads))
        # Each layer's (qkv, o, gate_up, down) weights and the LM head's packed for lmops'
        # kernel (`pack_for_kernels`); None: the few-row products take inductor's loop.
        self.packed: list[tuple[torch.Tensor | None, ...]] = []
        self.packed_head: torch.Tensor | None = None
        self.drop_packed()
        device = qkv.device
        cos, sin = rope_cos_sin(torch.arange(cfg.max_seq_len, device=device), cfg.head_dim, cfg.rope_theta)
        half = cfg.head_dim // 2
        self.cos = cos  # (max_len, D) float32
        self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), 1)
        if device.type == "cpu":  # every tensor a step reads, the model's own included
            weights = [t for layer in self.layers for w in layer for t in _tensors(w)]
            move_to_huge_pages([*model.parameters(), *weights, *self.qk_norms, self.cos, self.sin_signed])

    def pack_for_kernels(self) -> None:
        """Pack the float32 CPU weights of the products for lmops' kernel (kernels.pack_weight),
        which the compiled decode graph's few-row products then read (int8 weights keep their
        own path); on huge pages as the weights are. Copies, taken once: an engine's weights
        never change in place (a new model version is a new engine)."""

        def pack(w) -> torch.Tensor | None:
            return pack_weight(w) if _float32_cpu(w) else None

        self.packed = [tuple(pack(w) for w in (qkv, o, gu, down)) for _, qkv, o, _, gu, down in self.layers]
        self.packed_head = pack(self.model.lm_head.weight)
        if packed := self.packed_tensors():
            move_to_huge_pages(packed)

    def drop_packed(self) -> None:
        """No packed copies (or none any more: the graphs that would read them failed)."""
        self.packed, self.packed_head = [(None,) * 4 for _ in self.layers], None

    def packed_tensors(self) -> list[torch.Tensor]:
        """The packed copies there are (`pack_for_kernels`)."""
        return [b for b in (*(b for layer in self.packed for b in layer), self.packed_head) if b is not None]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attend) -> torch.Tensor:
        """(T,) ids and positions -> (T, n_embd) hidden states (before the final norm)."""
        H, Hkv, D, inter = self.n_head, self.n_kv, self.head_dim, self.inter
        T = input_ids.shape[0]
        x = F.embedding(input_ids, self.model.model.embed_tokens.weight)
        dtype = x.dtype
        # RoPE for the H query and Hkv key heads; identity (cos 1, sin 0) for the V heads, so
        # one elementwise pass rotates q and k and leaves K and V adjacent for the cache write.
        # rotate_half(x) * sin == swap_halves(x) * (sin with its first half negated).
        cos = self.cos.index_select(0, positions).to(dtype)[:, None]
        sin = self.sin_signed.index_select(0, positions).to(dtype)[:, None]
        cos = torch.cat((cos.expand(T, H + Hkv, D), cos.new_ones(T, Hkv, D)), 1)
        sin = torch.cat((sin.expand(T, H + Hkv, D), sin.new_zeros(T, Hkv, D)), 1)
        for i, (w_in, w_qkv, w_o, w_post, w_gu, w_down) in enumerate(self.layers):
            p_qkv, p_o, p_gu, p_down = self.packed[i]
            qkv = norm_linear(x, w_in, w_qkv, self.eps, p_qkv).view(T, H + 2 * Hkv, D)
            if self.qk_norms:
                qk = rms_norm(qkv[:, : H + Hkv], self.qk_norms[i], self.eps)
                qkv = torch.cat((qk, qkv[:, H + Hkv :]), 1)
            x1, x2 = qkv.chunk(2, dim=-1)
            qkv = torch.addcmul(torch.cat((x2, x1), dim=-1).mul_(sin), qkv, cos)
            y = attn(i, qkv[:, :H], qkv[:, H:])
            x = x + linear(y.reshape(T, H * D), w_o, p_o)
            gu = norm_linear(x, w_post, w_gu, self.eps, p_gu)
            x.add_(linear(F.silu(gu[:, :inter]).mul_(gu[:, inter:]), w_down, p_down))
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states (rows, n_embd) -> float32 logits (rows, vocab): final norm, LM head."""
        m = self.model
        return norm_linear(h, m.model.norm.weight, m.lm_head.weight, self.eps, self.packed_head).float()


def linear(x: torch.Tensor, w, packed: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w)` (`w` a weight tensor or a quantize.Int8Weight); for few rows in a
    compiled CPU graph, our own product (`_own_loop`), through lmops' kernel where `packed`
    is `w` packed for it."""
    return _few_rows(x, w, packed) if _own_loop(x, w) else F.linear(x, w)


def norm_linear(
    x: torch.Tensor, norm_weight: torch.Tensor, w, eps: float, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """`linear(rms_norm(x, norm_weight, eps), w)`. In our own product each row's 1/rms
    scales the product's outputs, not its inputs: inlined into inductor's loop, the norm
    cost a square root per 16 weights read (the LM head over 5 rows 3.6x slower, over 1 row 1.4x)."""
    if _own_loop(x, w):
        return _few_rows(x * norm_weight, w, packed) * inv_rms(x, eps)
    return F.linear(rms_norm(x, norm_weight, eps), w)


def _own_loop(x: torch.Tensor, w) -> bool:
    """Whether `x @ w.T` is a float32 product of fewer than SMALL_PRODUCT_ROWS rows inside a
    compiled CPU graph: there it is lmops' kernel or inductor's loop (`_few_rows`), where
    aten.mm would call MKL, whose single-row and few-row products take their generic,
    pre-AVX code on AMD CPUs (`mkl_blas_def_xsgemv`: over half of a batch-1 decode step's
    time). The eager path keeps F.linear (benchmarks/README.md, "The single-row products")."""
    return torch.compiler.is_compiling() and _float32_cpu(w) and x.shape[0] < SMALL_PRODUCT_ROWS


def _float32_cpu(w) -> bool:
    """Whether a weight is a float32 CPU tensor (not a quantize.Int8Weight): what our own
    products take."""
    return isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.device.type == "cpu"


def _few_rows(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """`x @ w.T` for a few rows in a compiled graph: lmops' kernel on `packed`, `w` packed
    for it (engine/kernels.py: it reads the weight once for every 6 rows), or without it
    (the kernels not built), inductor's loop."""
    if packed is not None:
        return torch.ops.lmops.small_linear(x, packed, w.shape[0])
    return _row_sums(x, w)


def _row_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x @ w.T` as a multiply and a sum a row: inductor fuses the rows' sums into one loop
    over the weight (one sum over a (rows, out, in) product loops over it once a row: 1.6x
    slower at 5 rows)."""
    return torch.cat([(x[r : r + 1, None, :] * w).sum(-1) for r in range(x.shape[0])])


def _tensors(w) -> list[torch.Tensor]:
    """A weight's tensors: itself, or a quantize.Int8Weight's."""
    return [w] if isinstance(w, torch.Tensor) else w.tensors()


def _fuse(*linears: torch.nn.Linear) -> torch.Tensor:
    """One weight stacking the linears' rows; each linear's weight becomes a view into it."""
    fused = torch.cat([lin.weight.detach() for lin in linears])
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = fused[start : start + n]
        start += n
    return fused
