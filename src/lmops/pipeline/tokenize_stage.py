"""The tokenize stage: byte-level BPE (HF `tokenizers`) trained on the train split
only, and every split encoded to a flat little-endian integer `.bin` (np.memmap).

The saved `tokenizer.json` + `tokenizer_config.json` load in `transformers`'
`PreTrainedTokenizerFast` unchanged, and at run time through `lmops.runtime.tokenizer`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lmops import atomic
from lmops.errors import LmopsError
from lmops.pipeline.data import SPLITS
from lmops.pipeline.params import TokenizerConfig
from lmops.pipeline.paths import PROCESSED_DIR, TOKENIZER_DIR
from lmops.runtime.tokenizer import SPECIAL_TOKENS, chunks, encode

log = logging.getLogger(__name__)

MIN_VOCAB = 256 + len(SPECIAL_TOKENS)
# The chat template saved with the tokenizer (tokenizer_config.json's "chat_template",
# rendered by /v1/chat/completions as transformers' apply_chat_template renders it). The
# model is a base model trained on plain text, with no chat tokens, so the template is a
# plain transcript: "Role: content" paragraphs, and "Assistant:" for the model to continue:
#     System: Be brief.\n\nUser: Hi\n\nAssistant:
# A deployment can replace it (LMOPS_CHAT_TEMPLATE, a Jinja file).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['role'] | capitalize }}: {{ message['content'] | trim }}{{ '\\n\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}Assistant:{% endif -%}"
)


def train_tokenizer(texts: Iterator[str] | list[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    if vocab_size < MIN_VOCAB:
        raise LmopsError(
            f"tokenizer.vocab_size={vocab_size} is too small: byte-level BPE needs the 256 byte "
            f"symbols plus {len(SPECIAL_TOKENS)} special tokens, so at least {MIN_VOCAB}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, directory: Path, model_max_length: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": SPECIAL_TOKENS[0],
        "bos_token": SPECIAL_TOKENS[1],
        "eos_token": SPECIAL_TOKENS[2],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def read_tokens(path: str | Path, vocab_size: int) -> np.ndarray:
    path = Path(path)
    if not path.is_file():
        raise LmopsError(f"{path} not found: run `lmops tokenize` first")
    if path.stat().st_size == 0:
        raise LmopsError(f"{path} is empty")
    return np.memmap(path, dtype=token_dtype(vocab_size), mode="r")


def tokenize(
    cfg: TokenizerConfig, max_seq_len: int, data_dir: Path = PROCESSED_DIR, out_dir: Path = TOKENIZER_DIR
) -> dict:
    """Train on train.txt, write the tokenizer, encode each split to `<split>.bin`."""
    texts = {}
    for name in SPLITS:
        path = data_dir / f"{name}.txt"
        if not path.is_file():
            raise LmopsError(f"{path} not found: run `lmops split` first")
        texts[name] = path.read_text(encoding="utf-8")
    tok = train_tokenizer(chunks(texts["train"]), cfg.vocab_size, cfg.min_frequency)
    vocab_size = tok.get_vocab_size()
    stats: dict = {"vocab_size": vocab_size, "dtype": token_dtype(vocab_size).name, "splits": {}}
    for name, text in texts.items():
        ids = encode(tok, text)
        if len(ids) < 2:
            raise LmopsError(f"{name} split encodes to {len(ids)} token(s); the corpus is too small")
        n_bytes = len(text.encode("utf-8"))
        atomic.write_bytes(data_dir / f"{name}.bin", ids.astype(token_dtype(vocab_size)).tobytes())
        stats["splits"][name] = {
            "tokens": int(len(ids)),
            "bytes": n_bytes,
            "bytes_per_token": round(n_bytes / len(ids), 4),
        }
    with atomic.directory(out_dir) as tmp:
        save_tokenizer(tok, tmp, max_seq_len)
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    log.info("tokenizer: vocab %d, %s", vocab_size, stats["splits"])
    return stats
