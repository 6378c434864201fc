import math

import pytest
import torch

from lmops.pipeline.evaluate import score
from lmops.pipeline.params import EvaluateConfig
from lmops.pipeline.tokenize_stage import train_tokenizer
from lmops.runtime.model import Llama
from lmops.runtime.model_config import LlamaConfig
from lmops.runtime.tokenizer import chunks, encode, token_byte_lengths

TEXT = "".join(f"print('line {i} → ok')\n" for i in range(300))


def test_uniform_model_scores_log_vocab_nats_per_token():
    tok = train_tokenizer([TEXT], vocab_size=300)
    shape = {"n_layer": 1, "n_head": 2, "n_kv_heads": 1, "n_embd": 16, "intermediate_size": 32}
    model = Llama(LlamaConfig(vocab_size=tok.get_vocab_size(), max_seq_len=32, tie_embeddings=False, **shape))
    model.eval()
    torch.nn.init.zeros_(model.lm_head.weight)  # every logit 0: a uniform distribution
    result = score(model, tok, chunks(TEXT), EvaluateConfig(max_batches=1000, batch_size=4))
    ids = encode(tok, TEXT)
    n_windows = (len(ids) - 1) // 32
    targets = [ids[i * 32 + 1 : (i + 1) * 32 + 1] for i in range(n_windows)]
    n_bytes = sum(int(token_byte_lengths(tok)[t].sum()) for t in targets)
    assert result["tokens"] == n_windows * 32 and result["bytes"] == n_bytes
    assert result["loss"] == pytest.approx(math.log(tok.get_vocab_size()), rel=1e-5)
    assert result["perplexity"] == pytest.approx(tok.get_vocab_size(), rel=1e-4)
    assert result["bits_per_byte"] == pytest.approx(result["tokens"] * math.log2(300) / n_bytes, rel=1e-5)


def test_max_batches_caps_the_work():
    tok = train_tokenizer([TEXT], vocab_size=300)
    model = Llama(
        LlamaConfig(
            vocab_size=300, n_layer=1, n_head=2, n_kv_heads=1, n_embd=16, intermediate_size=32, max_seq_len=16
        )
    ).eval()
    cfg = EvaluateConfig(max_batches=2, batch_size=3)
    whole = score(model, tok, chunks(TEXT), cfg)
    assert whole["tokens"] == 2 * 3 * 16
    # A long split is encoded only as far as the capped windows reach (one batch of its
    # 64K-character pieces here), with the same numbers as from the whole text.
    read = []
    long = TEXT * 2000
    pieces = list(chunks(long))
    assert len(pieces) > 100
    assert score(model, tok, (read.append(p) or p for p in pieces), cfg) == score(
        model, tok, chunks(long), cfg
    )
    assert len(read) <= 16
