"""A model directory with random weights, in exactly the layout the pipeline exports.

What tests and benchmarks load when the weights do not matter (parity, plumbing, speed):
one builder, so the layout they exercise is the real one.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

from lmops.pipeline.tokenize_stage import save_tokenizer, train_tokenizer
from lmops.runtime.model import Llama
from lmops.runtime.model_config import LlamaConfig
from lmops.runtime.model_dir import ModelMeta, write_model_dir


def random_model_dir(
    directory: Path,
    texts: Iterable[str],
    vocab_size: int,
    max_seq_len: int,
    *,
    seed: int | None = None,
    init_std: float | None = None,
    meta: dict | None = None,
    **shape,
) -> Path:
    """Train a BPE of `vocab_size` on `texts`, draw a Llama of `shape` (LlamaConfig's
    defaults: the training default size), save both to `directory` and return it.

    `seed` fixes the weights; `init_std` redraws every matrix from N(0, init_std), wider
    than the training init so that logits are well separated, and QK-norm weights from
    U(0.5, 1.5), so that a query norm applied as a key norm shows; `meta` (ModelMeta's
    fields) becomes lmops.json.
    """
    tok = train_tokenizer(texts, vocab_size=vocab_size)
    if seed is not None:
        torch.manual_seed(seed)
    model = Llama(LlamaConfig(vocab_size=tok.get_vocab_size(), max_seq_len=max_seq_len, **shape))
    if init_std is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, init_std)
                elif name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.uniform_(0.5, 1.5)
    with tempfile.TemporaryDirectory(prefix="lmops-tokenizer-") as tokenizer_dir:
        save_tokenizer(tok, Path(tokenizer_dir), max_seq_len)
        write_model_dir(model, Path(tokenizer_dir), directory, ModelMeta.model_validate(meta or {}))
    return directory
