"""Sampling from a model directory with a contiguous KV cache.

The small, dependency-free path used by evaluation samples and the MLflow
pyfunc; the service uses the paged engine in `lmops.engine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from lmops.model import KVCache, Llama, resolve_device
from lmops.tokenizer import load_tokenizer


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 0.95
    seed: int = 1337


def sample_next(logits: torch.Tensor, s: Sampling, gen: torch.Generator) -> torch.Tensor:
    """One token per row of `logits` (B, V): greedy at temperature 0, else top-k/top-p."""
    if s.temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / s.temperature
    if 0 < s.top_k < logits.size(-1):
        kth = torch.topk(logits, s.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > s.top_p  # keep the token that crosses top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)


@torch.no_grad()
def complete(model: Llama, tokenizer, prompt: str, s: Sampling) -> str:
    """The completion of one prompt (prompt excluded), stopping at </s> or the context end."""
    cfg = model.config
    device = next(model.parameters()).device
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids or [cfg.bos_token_id]
    ids = ids[-(cfg.block_size - 1):]
    budget = min(s.max_new_tokens, cfg.block_size - len(ids))
    gen = torch.Generator().manual_seed(s.seed)
    cache = KVCache(cfg, 1, cfg.block_size, device, next(model.parameters()).dtype)
    x = torch.tensor([ids], device=device)
    pos = torch.arange(len(ids), device=device)[None]
    out: list[int] = []
    for _ in range(budget):
        logits, _ = model(x, positions=pos, cache=cache)
        tok = int(sample_next(logits[:, -1], s, gen)[0])
        if tok == cfg.eos_token_id:
            break
        out.append(tok)
        x = torch.tensor([[tok]], device=device)
        pos = torch.tensor([[cache.length]], device=device)
    return tokenizer.decode(out)


def complete_from_dir(model_dir: str | Path, prompts: list[str], s: Sampling, device: str = "auto") -> list[str]:
    model = Llama.from_pretrained(model_dir, device=resolve_device(device))
    tokenizer = load_tokenizer(model_dir)
    return [complete(model, tokenizer, p, s) for p in prompts]
