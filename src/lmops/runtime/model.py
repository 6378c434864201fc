"""Llama-style decoder in one readable file: RMSNorm, RoPE, GQA attention, SwiGLU MLP.

Parameter names and math follow Hugging Face's `LlamaForCausalLM` exactly (with
`qk_norm`, `Qwen3ForCausalLM`: the same plus `q_norm`/`k_norm`), so a model directory
saved here loads in `transformers` (and other Llama and Qwen3 runtimes) unchanged, and
parity with `transformers` is a test, not a hope.

Attention is the one pluggable part: `forward(..., cache=None)` runs plain causal
attention over whole sequences (training, evaluation); a cache object with an
`attend(layer, q, k, v)` method decides where keys and values live: the
contiguous `KVCache` below, the reference that the engine (whose fused forward,
engine/forward.py, attends over its paged cache itself) is tested against.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from pydantic import ValidationError
from safetensors.torch import load_file, save
from torch import nn

from lmops.errors import LmopsError
from lmops.runtime.generation_config import GENERATION_DEFAULTS, GENERATION_FILE
from lmops.runtime.json_files import read_json_object
from lmops.runtime.model_config import LlamaConfig
from lmops.runtime.model_dir import CONFIG_FILE, WEIGHTS_FILE, verify


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` = CUDA when present, else CPU. Asking for CUDA without one is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise LmopsError(f"device {name!r} requested but CUDA is not available on this machine")
    return torch.device(name)


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA, float32 on CPU (CPU bf16 matmuls are slow and lossy)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def bf16_native(device: torch.device) -> bool:
    """Whether matrix products run natively in bfloat16 here: CUDA that supports it, or a
    CPU with AVX512-BF16 or AMX (where oneDNN's bfloat16 GEMM is about twice float32's)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


class AttentionCache(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (B, T, H, D), k/v: (B, T, Hkv, D) already rotated -> (B, T, H, D)."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF's Llama computes it: in float32, back to x's dtype, then the weight
    (the engine's forward calls this too)."""
    xf = x.float()
    return weight * (xf * inv_rms(xf, eps)).to(x.dtype)


def inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / RMS(x) over the last dimension, kept: RMSNorm's scale of each row."""
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape positions.shape + (head_dim,), computed in float32 like HF."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim)
    )
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, D); cos/sin: (B, T, D). Llama's rotate-half convention."""
    cos, sin = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0
) -> torch.Tensor:
    """Plain causal self-attention over whole sequences; (B, T, H, D) in and out.

    On CPU it runs in float32 even under bfloat16 autocast: torch's CPU flash-attention
    kernel takes 1.4x as long in bfloat16, forward and backward (benchmarks/README.md).
    """
    dtype, cpu = q.dtype, q.device.type == "cpu"
    with torch.autocast("cpu", enabled=False) if cpu else contextlib.nullcontext():
        y = F.scaled_dot_product_attention(
            *(t.transpose(1, 2).float() if cpu else t.transpose(1, 2) for t in (q, k, v)),
            dropout_p=dropout_p,
            is_causal=True,
            enable_gqa=True,
        )
    return y.transpose(1, 2).to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        self.layer, self.n_head, self.n_kv, self.head_dim = layer, cfg.n_head, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.dropout, self.attention_dropout = cfg.dropout, cfg.attention_dropout_p

    def forward(self, x, cos, sin, cache: AttentionCache | None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
        if self.qk_norm:  # Qwen3: each head's queries and keys normed, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        if cache is None:
            y = causal_attention(q, k, v, self.attention_dropout if self.training else 0.0)
        else:
            y = cache.attend(self.layer, q, k, v)
        return F.dropout(self.o_proj(y.reshape(B, T, -1)), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.n_embd, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x):
        y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return F.dropout(y, self.dropout, self.training)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Named `model` inside `Llama` so parameter names match HF's `model.layers.N...`."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init_weights)
        # GPT-2 style: scale residual-branch outputs so the residual stream's variance
        # does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: AttentionCache | None = None,
    ) -> torch.Tensor:
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache)
        return self.model.norm(x)

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cache: AttentionCache | None = None,
    ):
        """Logits (B, T, V), and the mean cross-entropy when `targets` is given."""
        logits = self.lm_head(self.hidden_states(input_ids, positions, cache))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward), as in the PaLM paper's appendix."""
        c = self.config
        n = self.num_params() - (0 if c.tie_embeddings else c.vocab_size * c.n_embd)
        return 6 * n + 12 * c.n_layer * c.n_embd * c.max_seq_len

    # -- the model directory (Hugging Face's Llama or Qwen3 layout) -----------------

    def save_pretrained(self, directory: str | Path) -> None:
        """config.json, model.safetensors and generation_config.json (special ids + GENERATION_DEFAULTS);
        `lmops.runtime.model_dir.write_model_dir` adds the tokenizer and lmops.json."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in self.state_dict().items()}
        if self.config.tie_embeddings:
            state.pop("lm_head.weight")
        # Through a plain write: safetensors' save_file creates the file 0600, which the
        # unprivileged user of a container or another host user could not read.
        (directory / WEIGHTS_FILE).write_bytes(save(state, metadata={"format": "pt"}))
        (directory / CONFIG_FILE).write_text(json.dumps(self.config.to_hf(), indent=2) + "\n")
        ids = {"bos_token_id": self.config.bos_token_id, "eos_token_id": self.config.eos_token_id}
        (directory / GENERATION_FILE).write_text(json.dumps({**ids, **GENERATION_DEFAULTS}, indent=2) + "\n")

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> Llama:
        """Load a model directory's network, refusing weights that are corrupt, that are not
        the ones lmops.json recorded, or that hold a NaN or an infinity."""
        directory = Path(directory)
        verify(directory)
        config_path = directory / CONFIG_FILE
        try:
            cfg = LlamaConfig.from_hf(read_json_object(config_path, "model config"))
        except ValidationError as exc:
            problems = "; ".join(
                ": ".join([*map(str, e["loc"]), e["msg"].removeprefix("Value error, ")]) for e in exc.errors()
            )
            raise LmopsError(f"{config_path}: invalid model config ({problems})") from None
        except ValueError as exc:  # from_hf's own: a layout lmops does not run
            raise LmopsError(f"{config_path}: {exc}") from None
        except (KeyError, TypeError) as exc:
            raise LmopsError(f"{config_path}: unreadable model config ({exc!r})") from None
        weights = directory / WEIGHTS_FILE
        try:
            state = load_file(str(weights))
        except Exception as exc:  # safetensors raises its own error types for truncation/corruption
            raise LmopsError(f"{weights}: corrupt weights file ({exc})") from None
        bad = next(
            (name for name, t in state.items() if t.is_floating_point() and not t.isfinite().all()), None
        )
        if bad is not None:
            raise LmopsError(f"{weights}: corrupt weights file ({bad} holds NaN or infinite values)")
        model = cls(cfg)
        if cfg.tie_embeddings:
            state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            detail = " ".join(str(exc).split())  # torch's message spans lines; ours is one
            raise LmopsError(f"{directory}: weights do not match config.json ({detail})") from None
        return model.to(device=device, dtype=dtype).eval()


class KVCache:
    """Contiguous per-layer K/V buffers for batched generation from position `length`.

    The simple reference the paged engine (lmops.runtime.engine) is checked against:
    each step attends to everything cached so far, so decoding is linear in the
    sequence length, not quadratic.
    """

    def __init__(self, cfg: LlamaConfig, batch: int, max_len: int, device, dtype):
        shape = (cfg.n_layer, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    def attend(self, layer, q, k, v):
        T = q.shape[1]
        start, end = self.length, self.length + T
        self.k[layer, :, :, start:end] = k.transpose(1, 2)
        self.v[layer, :, :, start:end] = v.transpose(1, 2)
        keys, values = self.k[layer, :, :, :end], self.v[layer, :, :, :end]
        # Query i (absolute position start+i) sees keys 0..start+i.
        mask = torch.ones(T, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)
        if layer == len(self.k) - 1:
            self.length = end
        return y.transpose(1, 2)
