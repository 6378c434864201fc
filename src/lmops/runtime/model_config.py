"""The model's hyperparameters, their defaults and invariants, defined once, and their
mapping to and from Hugging Face's `config.json`: Llama's layout, or Qwen3's where
`qk_norm` is on (Qwen3 is Llama plus an RMSNorm over each head's queries and keys, so
one network serves both and every stock runtime that reads either loads the export).

Free of torch, so validating params.yaml (whose `model` section is `LlamaShape`) stays
quick for the stages that never build a model.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator


class LlamaShape(BaseModel):
    """The architecture: the one definition of the model's hyperparameters, their defaults
    and invariants. params.yaml's `model` section is this (lmops.pipeline.params.ModelConfig)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    n_layer: PositiveInt = 4
    n_head: PositiveInt = 6
    n_kv_heads: PositiveInt = 2
    n_embd: PositiveInt = 192
    intermediate_size: PositiveInt = 512
    max_seq_len: PositiveInt = 256
    rope_theta: Annotated[float, Field(gt=0)] = 10000.0
    norm_eps: Annotated[float, Field(gt=0)] = 1e-5
    tie_embeddings: bool = True
    # Qwen3's QK-norm: an RMSNorm (weights per head dim, shared by the heads) over each
    # head's queries and keys before RoPE; exported as Qwen3ForCausalLM. On: 3.4% lower test
    # bits/byte at 800 steps of the default corpus for a 6% longer training step
    # (benchmarks/README.md, "Architecture ablations"); false gives Llama's layout.
    qk_norm: bool = True
    # Training-only regularisation, off in eval and export: `dropout` on both residual
    # branches, `attention_dropout` on the attention weights (None = `dropout`). On CPU the
    # attention weights' mask (batch x heads x context^2 random draws per layer) costs far
    # more than the residual one (benchmarks/README.md, "Training speed").
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    attention_dropout: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None

    @model_validator(mode="after")
    def _heads_divide(self) -> LlamaShape:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_heads:
            raise ValueError(f"n_head ({self.n_head}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError("head dim (n_embd / n_head) must be even for RoPE")
        return self


# The smallest shape that still has GQA (4 query heads over 2 KV heads) and two layers: what
# tests build when the weights do not matter (LlamaShape's defaults for the rest).
TINY_SHAPE = {"n_layer": 2, "n_head": 4, "n_kv_heads": 2, "n_embd": 64, "intermediate_size": 128}


# The Hugging Face layouts a model directory may hold (`model_type` in config.json).
HF_MODEL_TYPES = ("llama", "qwen3")


class LlamaConfig(LlamaShape):
    """The shape plus what the tokenizer decides: vocabulary size and special token ids."""

    vocab_size: PositiveInt
    # HF writes null for a model without one; generation stops on eos (and on every id in
    # generation_config.json's eos_token_id: lmops.runtime.model_dir.eos_token_ids).
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def attention_dropout_p(self) -> float:
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    @property
    def hf_model_type(self) -> str:
        return "qwen3" if self.qk_norm else "llama"

    def to_hf(self) -> dict:
        layout = (
            {"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": False}
            if self.qk_norm
            else {
                "architectures": ["LlamaForCausalLM"],
                "mlp_bias": False,
            }
        )
        return {
            **layout,
            "model_type": self.hf_model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.n_embd,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.n_layer,
            "num_attention_heads": self.n_head,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_seq_len,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": self.attention_dropout_p,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
        }

    @classmethod
    def from_hf(cls, hf: dict) -> LlamaConfig:
        model_type = hf.get("model_type", "llama")
        if model_type not in HF_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not one lmops runs ({' or '.join(HF_MODEL_TYPES)})"
            )
        eos = hf.get("eos_token_id", 2)  # an int, null, or a list whose first is the model's own
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        rope_theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            vocab_size=hf["vocab_size"],
            n_layer=hf["num_hidden_layers"],
            n_head=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            n_embd=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            max_seq_len=hf["max_position_embeddings"],
            rope_theta=float(rope_theta),
            norm_eps=hf.get("rms_norm_eps", 1e-5),
            tie_embeddings=hf.get("tie_word_embeddings", False),
            qk_norm=model_type == "qwen3",
            dropout=hf.get("attention_dropout", 0.0),
            bos_token_id=hf.get("bos_token_id", 1),
            eos_token_id=eos,
        )
