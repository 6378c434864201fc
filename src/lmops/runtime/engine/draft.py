"""The draft model of speculative decoding (`EngineConfig.speculative_model`), a proposer
of drafts like scheduler.py's prompt lookup (`NgramProposer`).

`DraftModel` runs a small model that shares the target's tokenizer greedily k steps ahead: its draft is deterministic, so the target
verifies it as it does prompt lookup's (greedy agreement, or rejection sampling with a
point-mass proposal). Each sequence has its own contiguous KV cache (`model.KVCache`) and
the tokens it holds: before proposing, the cache is cut back to the longest prefix it
shares with the sequence's tokens (which drops whatever the target rejected) and the rest
is fed, so it stays in step under continuous batching without any bookkeeping of its own.
A preempted or finished sequence's cache is dropped (a preempted one recomputes it when it
drafts again); a forked sibling starts one of its own. The draft model runs one sequence
at a time: simple, correct, not yet batched.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from lmops.errors import LmopsError
from lmops.runtime.engine.sequence import Sequence
from lmops.runtime.model import KVCache, Llama
from lmops.runtime.tokenizer import load_tokenizer


class DraftModel:
    """A draft model's greedy proposals, with a KV cache per sequence up to `max_len` tokens."""

    def __init__(self, model: Llama, max_len: int):
        self.model, self.max_len = model.eval(), max_len
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.caches: dict[int, tuple[KVCache, list[int]]] = {}  # seq_id -> cache, the tokens it holds

    @classmethod
    def load(
        cls, directory: str | Path, tokenizer: Tokenizer, vocab_size: int, max_len: int, device, dtype
    ) -> DraftModel:
        """The model directory `directory` (config.json, model.safetensors, tokenizer.json),
        refused in one line unless its tokenizer and vocabulary are the target's."""
        d = Path(directory)
        if not d.is_dir():
            raise LmopsError(f"speculative_model: {d}: model directory not found")
        try:
            draft_tokenizer = load_tokenizer(d)
            model = Llama.from_pretrained(d, device, dtype)
        except LmopsError as exc:
            raise LmopsError(f"speculative_model: {exc}") from None
        if draft_tokenizer.get_vocab() != tokenizer.get_vocab() or model.config.vocab_size != vocab_size:
            raise LmopsError(
                f"speculative_model: {d} has another tokenizer than the target model's; a draft "
                "model must share it (its tokens are proposed as the target's)"
            )
        return cls(model, max_len)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.model.state_dict().values())

    @torch.inference_mode()
    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = seq.token_ids
        cache, held = self.caches.get(seq.seq_id) or (
            KVCache(self.model.config, 1, self.max_len, self.device, self.dtype),
            [],
        )
        common = next(
            (i for i, (a, b) in enumerate(zip(held, tokens, strict=False)) if a != b),
            min(len(held), len(tokens)),
        )
        common = min(common, len(tokens) - 1)  # the last token is fed again: its logits are wanted
        cache.length = common
        feed, draft = tokens[common:], []
        for _ in range(k):
            positions = torch.arange(cache.length, cache.length + len(feed), device=self.device)
            logits, _ = self.model(
                torch.tensor([feed], device=self.device), positions=positions[None], cache=cache
            )
            draft.append(int(logits[0, -1].argmax()))
            feed = draft[-1:]
        self.caches[seq.seq_id] = (cache, tokens + draft[:-1])  # the last draft token is not fed
        return draft

    def drop(self, seq: Sequence) -> None:
        self.caches.pop(seq.seq_id, None)
