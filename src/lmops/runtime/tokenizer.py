"""The tokenizer at run time: load a model directory's byte-level BPE, encode text,
and the UTF-8 byte length of every token (the denominator of bits per byte).

The serving side imports only this half; training the tokenizer and encoding the
splits to disk is the tokenize stage (`lmops.pipeline.tokenize_stage`). Special tokens use
Llama's ids: <unk>=0, <s>=1, </s>=2.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from lmops.errors import LmopsError

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
CHUNK_CHARS = 1 << 16  # encoding pieces: see `chunks`
ENCODE_BATCH = 16  # pieces per encode_batch call (its threads take one piece each)


def load_tokenizer(directory: str | Path) -> Tokenizer:
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise LmopsError(f"{directory}: missing tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
        raise LmopsError(f"{path}: unreadable tokenizer ({exc})") from None


def chunks(text: str) -> Iterator[str]:
    """Pieces of ~64K chars cut after a newline; byte-level BPE round-trips each exactly."""
    start = 0
    while start < len(text):
        end = text.find("\n", start + CHUNK_CHARS)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


def encode(tok: Tokenizer, text: str) -> np.ndarray:
    return encode_pieces(tok, chunks(text))


def encode_pieces(tok: Tokenizer, pieces: Iterable[str], at_least: int | None = None) -> np.ndarray:
    """The ids of the pieces' text (as `chunks` cuts it), a batch of pieces at a time; with
    `at_least`, only until that many are in, so a long text is not encoded (or held) whole."""
    out, n, it = [], 0, iter(pieces)
    while (at_least is None or n < at_least) and (batch := list(itertools.islice(it, ENCODE_BATCH))):
        for e in tok.encode_batch(batch, add_special_tokens=False):
            out.append(np.asarray(e.ids, dtype=np.int64))
            n += len(e.ids)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def token_byte_lengths(tok: Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special tokens): the denominator of bits/byte."""
    byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
    lengths = np.zeros(tok.get_vocab_size(), dtype=np.int64)
    for piece, idx in tok.get_vocab().items():
        if piece not in SPECIAL_TOKENS:
            lengths[idx] = sum(1 for ch in piece if ch in byte_decoder)
    return lengths


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-char table that byte-level BPE pieces are spelled in."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))
