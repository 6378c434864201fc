"""The tokenize stage: byte-level BPE (HF `tokenizers`) trained on a bounded, seeded sample
of the train split, and every split encoded into sharded token files with an index.

It streams: the splits are read in blocks and cut into the pieces the runtime encodes
(`lmops.runtime.tokenizer.chunks`: ~64K characters ending at a newline, so the ids are
those of encoding the whole text), encoded a batch at a time with `encode_batch_fast` (all
cores) and appended to shards of at most `tokenizer.shard_bytes`. The token directory
(data/processed/tokens: `<split>-<part>-<shard>.bin`, flat little-endian ids for
np.memmap, and `index.json`) is written beside and renamed into place whole, so a stage
killed midway leaves nothing that looks finished, and its rerun starts clean.

Encoding can also run as `parts` independent jobs (the Kubeflow pipeline's ParallelFor):
part k of n encodes the chunks that start in the k-th n-th of each split's bytes, and
`merge` joins the parts' directories into the one training reads, the same as one job's.

The saved `tokenizer.json` + `tokenizer_config.json` load in `transformers`'
`PreTrainedTokenizerFast` unchanged, and at run time through `lmops.runtime.tokenizer`.
"""

from __future__ import annotations

import codecs
import hashlib
import itertools
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lmops import atomic, crash_points
from lmops.errors import LmopsError
from lmops.pipeline.data import READ_BYTES, SPLITS, progress, record_throughput
from lmops.pipeline.params import AUTO, TokenizerConfig
from lmops.pipeline.paths import PROCESSED_DIR, TOKENIZER_DIR, TOKENS_DIR
from lmops.runtime.tokenizer import CHUNK_CHARS, SPECIAL_TOKENS, load_tokenizer

log = logging.getLogger(__name__)

MIN_VOCAB = 256 + len(SPECIAL_TOKENS)
# `tokenizer.vocab_size: auto` follows the train split's size: the largest power of two with
# at least BYTES_PER_ENTRY train bytes per vocabulary entry, within AUTO_VOCAB. On a small
# corpus a large vocabulary is many rare tokens whose embeddings barely train, and every
# entry is a row of the tied embedding and head (a third of the default model at 4096).
# Measured on tiny Shakespeare (1.0 MB of train split: 512, 1024 and 4096 entries scored
# 2.126, 2.116 and 2.169 bits/byte; benchmarks/README.md, "The training recipe"); the
# default corpus (11 MB) keeps 4096.
BYTES_PER_ENTRY = 500
AUTO_VOCAB = (512, 4096)
SAMPLE_PIECE = 1 << 16  # the tokenizer's training sample is pieces of whole lines of about this size
INDEX = "index.json"
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


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
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


def auto_vocab_size(train_bytes: int) -> int:
    """`tokenizer.vocab_size: auto`: the largest power of two in AUTO_VOCAB with at least
    BYTES_PER_ENTRY train bytes per entry (the bounds where there is less or more)."""
    low, high = AUTO_VOCAB
    size = low
    while size * 2 <= high and size * 2 * BYTES_PER_ENTRY <= train_bytes:
        size *= 2
    return size


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def split_path(data_dir: Path, name: str) -> Path:
    path = data_dir / f"{name}.txt"
    if not path.is_file():
        raise LmopsError(f"{path} not found: run `lmops split` first")
    return path


def text_chunks(path: Path, part: int = 0, parts: int = 1) -> Iterator[tuple[int, str]]:
    """(byte length, text) of the pieces `lmops.runtime.tokenizer.chunks` cuts the file's text
    into, read in blocks; only those starting in the file's `part`-th of `parts` byte ranges."""
    size = path.stat().st_size
    lo, hi = size * part // parts, size * (part + 1) // parts
    decoder = codecs.getincrementaldecoder("utf-8")()
    buf, at = "", 0  # `at`: the byte offset of buf's start in the file
    with open(path, "rb") as fh:
        while True:
            data = fh.read(READ_BYTES)
            buf += decoder.decode(data, final=not data)
            start = 0
            while start < len(buf):
                end = buf.find("\n", start + CHUNK_CHARS)
                if end < 0:
                    if data:
                        break  # the rest of the file may hold this piece's newline
                    end = len(buf) - 1
                piece = buf[start : end + 1]
                if at >= hi:
                    return
                n = len(piece.encode("utf-8"))
                if at >= lo:
                    yield n, piece
                at, start = at + n, end + 1
            buf = buf[start:]
            if not data:
                return


class TrainingSample:
    """The train split's text the BPE learns from: all of it, in encoding's pieces, when it is
    at most `budget` bytes; else pieces of whole lines at seeded random places, in file order,
    at most `budget` bytes in all. `bytes` counts what was read."""

    def __init__(self, path: Path, budget: int, seed: int):
        self.path, self.budget, self.seed, self.bytes = path, budget, seed, 0

    def __iter__(self) -> Iterator[str]:
        size = self.path.stat().st_size
        if size <= self.budget:
            for n, piece in text_chunks(self.path):
                self.bytes += n
                yield piece
            return
        n_pieces = size // SAMPLE_PIECE
        chosen = np.random.default_rng(self.seed).choice(n_pieces, self.budget // SAMPLE_PIECE, replace=False)
        with open(self.path, "rb") as fh:
            for i in np.sort(chosen).tolist():
                fh.seek(i * SAMPLE_PIECE)
                data = fh.read(SAMPLE_PIECE)
                data = data[data.find(b"\n") + 1 if i else 0 : data.rfind(b"\n") + 1]  # whole lines
                self.bytes += len(data)
                yield data.decode("utf-8")


def encode_chunks(
    tok: Tokenizer, chunks: Iterable[tuple[int, str]], dtype: np.dtype, bar
) -> Iterator[np.ndarray]:
    """The ids of `chunks`, a batch at a time through `encode_batch_fast` (its threads use every
    core; the same ids as `encode_batch`, without the offsets, in less time and memory)."""
    batch_size = max(16, 4 * (os.cpu_count() or 1))
    it = iter(chunks)
    while batch := list(itertools.islice(it, batch_size)):
        encodings = tok.encode_batch_fast([text for _, text in batch], add_special_tokens=False)
        yield np.concatenate([np.asarray(e.ids, dtype=dtype) for e in encodings])
        bar.update(sum(n for n, _ in batch))


def _write_shards(directory: Path, stem: str, arrays: Iterable[np.ndarray], shard_tokens: int) -> list[dict]:
    """`arrays` appended to `<stem>-<shard>.bin` files of at most `shard_tokens` ids each."""
    shards: list[dict] = []
    fh = None
    for ids in arrays:
        while len(ids):
            if fh is None or shards[-1]["tokens"] == shard_tokens:
                if fh is not None:
                    fh.close()
                crash_points.reached("tokenize.shard", len(shards))
                shards.append(
                    {"file": f"{stem}-{len(shards):05d}.bin", "tokens": 0, "sha256": hashlib.sha256()}
                )
                fh = open(directory / shards[-1]["file"], "wb")  # noqa: SIM115 (closed when full or at the end)
            room = shard_tokens - shards[-1]["tokens"]
            head, ids = ids[:room], ids[room:]
            data = head.tobytes()
            fh.write(data)
            shards[-1]["sha256"].update(data)
            shards[-1]["tokens"] += len(head)
    if fh is not None:
        fh.close()
    return [{**s, "sha256": s["sha256"].hexdigest()} for s in shards]


def encode_splits(
    tok: Tokenizer, cfg: TokenizerConfig, data_dir: Path, out_dir: Path, part: int = 0, parts: int = 1
) -> dict:
    """Encode part `part` of `parts` of every split into a new token directory `out_dir`; its index."""
    vocab_size = tok.get_vocab_size()
    dtype = token_dtype(vocab_size)
    shard_tokens = max(1, cfg.shard_bytes // dtype.itemsize)
    paths = {name: split_path(data_dir, name) for name in SPLITS}
    total = sum(p.stat().st_size for p in paths.values()) // parts
    index = {
        "vocab_size": vocab_size,
        "dtype": dtype.name,
        "shard_tokens": shard_tokens,
        "tokenizer_sha256": tokenizer_digest(tok),
        "part": part,
        "parts": parts,
        "splits": {},
    }
    atomic.remove_stale(out_dir)
    started = time.perf_counter()
    with atomic.directory(out_dir) as tmp, progress("tokenize", total) as bar:
        for name, path in paths.items():
            chunks = text_chunks(path, part, parts)
            shards = _write_shards(
                tmp, f"{name}-{part:03d}", encode_chunks(tok, chunks, dtype, bar), shard_tokens
            )
            index["splits"][name] = {"tokens": sum(s["tokens"] for s in shards), "shards": shards}
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return {**index, "seconds": time.perf_counter() - started}  # the time not in the file


def merge(part_dirs: list[Path], out_dir: Path) -> dict:
    """Join the token directories of parts 0..n-1 (given in any order) into one; its index."""
    indexes = sorted(((_read_index(d), d) for d in part_dirs), key=lambda pair: pair[0]["part"])
    part_dirs, indexes = [d for _, d in indexes], [i for i, _ in indexes]
    if [i["part"] for i in indexes] != list(range(indexes[0]["parts"])):
        found = ", ".join(str(i["part"]) for i in indexes)
        raise LmopsError(f"tokenize --merge: need parts 0..{indexes[0]['parts'] - 1}, found {found}")
    index = {k: indexes[0][k] for k in ("vocab_size", "dtype", "shard_tokens", "tokenizer_sha256")}
    index |= {"part": 0, "parts": 1, "merged_parts": len(indexes)}
    if len({i["tokenizer_sha256"] for i in indexes}) > 1:
        raise LmopsError(
            f"{', '.join(map(str, part_dirs))}: the parts were encoded with different tokenizers"
        )
    index["splits"] = {
        name: {
            "tokens": sum(i["splits"][name]["tokens"] for i in indexes),
            "shards": [s for i in indexes for s in i["splits"][name]["shards"]],
        }
        for name in SPLITS
    }
    atomic.remove_stale(out_dir)
    with atomic.directory(out_dir) as tmp:
        for d, i in zip(part_dirs, indexes, strict=True):
            for s in (s for split in i["splits"].values() for s in split["shards"]):
                shutil.copyfile(d / s["file"], tmp / s["file"])
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return index


def tokenizer_digest(tok: Tokenizer) -> str:
    """What identifies a tokenizer: the ids of token files encoded with it mean its vocabulary."""
    return hashlib.sha256(tok.to_str().encode()).hexdigest()


def check_tokenizer(tokens_dir: Path, tok: Tokenizer) -> None:
    """Stop when the token files were encoded with another tokenizer (a tokenize stage killed
    between its two outputs, or outputs copied from elsewhere)."""
    if _read_index(tokens_dir).get("tokenizer_sha256") != tokenizer_digest(tok):
        raise LmopsError(f"{tokens_dir} was encoded with another tokenizer: run `lmops tokenize` again")


def _read_index(directory: Path) -> dict:
    path = directory / INDEX
    if not path.is_file():
        raise LmopsError(f"{path} not found: run `lmops tokenize` first")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise LmopsError(f"{path} is damaged (not JSON): run `lmops tokenize` again") from None


class Tokens:
    """One split's token ids across its shards, memory-mapped: `len()` and slices `[a:b]`
    (a window may span two shards); `digest` names the exact ids (from the shards' sha256)."""

    def __init__(self, directory: Path, name: str):
        index = _read_index(directory)
        entry = index["splits"].get(name)
        if not entry or not entry["tokens"]:
            raise LmopsError(f"{directory / INDEX}: split {name!r} has no tokens")
        dtype = np.dtype(index["dtype"])
        self._shards = []
        for s in entry["shards"]:
            path = directory / s["file"]
            if not path.is_file() or path.stat().st_size != s["tokens"] * dtype.itemsize:
                raise LmopsError(f"{path} is missing or damaged: run `lmops tokenize` again")
            self._shards.append(np.memmap(path, dtype=dtype, mode="r"))
        self._starts = np.cumsum([0] + [len(s) for s in self._shards])
        self.digest = hashlib.sha256("".join(s["sha256"] for s in entry["shards"]).encode()).hexdigest()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop, _ = key.indices(len(self))
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            lo = start - self._starts[first]
            take = min(stop - start, len(self._shards[first]) - lo)
            pieces.append(self._shards[first][lo : lo + take])
            start, first = start + take, first + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def read_tokens(directory: str | Path, name: str) -> Tokens:
    return Tokens(Path(directory), name)


def tokenize(
    cfg: TokenizerConfig,
    max_seq_len: int,
    data_dir: Path = PROCESSED_DIR,
    out_dir: Path = TOKENIZER_DIR,
    tokens_dir: Path | None = None,
) -> dict:
    """Train on a sample of train.txt, write the tokenizer, encode the splits into `tokens_dir`."""
    tokens_dir = data_dir / TOKENS_DIR.name if tokens_dir is None else tokens_dir
    stats = train_and_save(cfg, max_seq_len, data_dir, out_dir)
    index = encode_splits(load_tokenizer(out_dir), cfg, data_dir, tokens_dir)
    return write_stats(out_dir, stats, index, data_dir)


def train_and_save(cfg: TokenizerConfig, max_seq_len: int, data_dir: Path, out_dir: Path) -> dict:
    """Train the BPE on the sample and save it (with the sample's stats) to `out_dir`."""
    paths = {name: split_path(data_dir, name) for name in SPLITS}
    started = time.perf_counter()
    sample = TrainingSample(paths["train"], cfg.train_bytes, cfg.seed)
    train_bytes = paths["train"].stat().st_size
    auto = cfg.vocab_size == AUTO
    vocab_size = auto_vocab_size(train_bytes) if auto else cfg.vocab_size
    if auto:
        log.info("auto chose tokenizer.vocab_size %d for %d train bytes", vocab_size, train_bytes)
    tok = train_tokenizer(sample, vocab_size, cfg.min_frequency)
    stats = {
        "vocab_size": tok.get_vocab_size(),
        "dtype": token_dtype(tok.get_vocab_size()).name,
        "trained_on_bytes": sample.bytes,
        "train_split_bytes": train_bytes,
        **({"auto.vocab_size": vocab_size} if auto else {}),
    }
    seconds = time.perf_counter() - started
    record_throughput("tokenizer_training", seconds, sample.bytes)
    atomic.remove_stale(out_dir)
    with atomic.directory(out_dir) as tmp:
        save_tokenizer(tok, tmp, max_seq_len)
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    log.info(
        "tokenizer: vocab %d, trained on %d of the train split's %d bytes in %.1f s",
        stats["vocab_size"],
        stats["trained_on_bytes"],
        stats["train_split_bytes"],
        seconds,
    )
    return stats


def write_stats(out_dir: Path, stats: dict, index: dict, data_dir: Path) -> dict:
    """The tokenizer's stats.json with what encoding wrote: tokens, bytes, shards, throughput."""
    stats = dict(stats, splits={})
    n_bytes = 0
    for name, entry in index["splits"].items():
        size = (data_dir / f"{name}.txt").stat().st_size
        n_bytes += size
        if entry["tokens"] < 2:
            raise LmopsError(f"{name} split encodes to {entry['tokens']} token(s); the corpus is too small")
        stats["splits"][name] = {
            "tokens": entry["tokens"],
            "bytes": size,
            "bytes_per_token": round(size / entry["tokens"], 4),
            "shards": len(entry["shards"]),
        }
    atomic.write_json(out_dir / "stats.json", stats)
    if "seconds" in index:  # encoded here, not merged from parts encoded elsewhere
        log.info(
            "tokens: %s; %.1f MB/s", stats["splits"], record_throughput("tokenize", index["seconds"], n_bytes)
        )
    return stats
