import json

import pytest

from lmops.errors import LmopsError
from lmops.pipeline.params import TokenizerConfig
from lmops.pipeline.tokenize_stage import (
    BYTES_PER_ENTRY,
    auto_vocab_size,
    read_tokens,
    save_tokenizer,
    tokenize,
    train_tokenizer,
)
from lmops.runtime.tokenizer import encode, load_tokenizer, token_byte_lengths

TEXT = "".join(f"def function_{i}(x, y):\n    return x * {i} + y  # ünïcödé ✓\n\n" for i in range(400))


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([TEXT], vocab_size=320)


def test_vocab_too_small_for_byte_level():
    with pytest.raises(LmopsError, match="at least 259"):
        train_tokenizer(["abc"], vocab_size=200)


def test_round_trip_and_special_ids(tok):
    ids = encode(tok, TEXT)
    assert tok.decode(ids.tolist()) == TEXT
    assert [tok.token_to_id(t) for t in ("<unk>", "<s>", "</s>")] == [0, 1, 2]
    unseen = "日本語 and emoji 🐍 never seen in training"
    assert tok.decode(encode(tok, unseen).tolist()) == unseen  # byte-level: nothing is unknown


def test_token_byte_lengths_count_utf8_bytes(tok):
    ids = encode(tok, TEXT)
    assert token_byte_lengths(tok)[ids].sum() == len(TEXT.encode("utf-8"))


def test_transformers_loads_the_saved_tokenizer(tok, tmp_path):
    from transformers import AutoTokenizer

    save_tokenizer(tok, tmp_path, model_max_length=64)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    sample = "def f(x):\n    return x ✓"
    assert hf(sample)["input_ids"] == tok.encode(sample).ids
    assert hf.eos_token_id == 2 and hf.bos_token_id == 1 and hf.model_max_length == 64
    assert load_tokenizer(tmp_path).get_vocab_size() == tok.get_vocab_size()


def test_tokenize_stage_writes_bins_and_stats(tmp_path):
    data = tmp_path / "processed"
    data.mkdir()
    for name, text in {"train": TEXT, "val": TEXT[:3000], "test": TEXT[3000:6000]}.items():
        (data / f"{name}.txt").write_text(text)
    stats = tokenize(TokenizerConfig(vocab_size=300, min_frequency=2), 64, data, tmp_path / "tok")
    assert stats["dtype"] == "uint16" and stats["vocab_size"] == 300
    tok = load_tokenizer(tmp_path / "tok")
    for name in ("train", "val", "test"):
        ids = read_tokens(data / "tokens", name)
        assert tok.decode(ids[:].tolist()) == (data / f"{name}.txt").read_text()
        assert stats["splits"][name]["tokens"] == len(ids)
    assert json.loads((tmp_path / "tok" / "stats.json").read_text()) == stats


def test_auto_vocab_size_follows_the_train_split():
    """A power of two with at least BYTES_PER_ENTRY train bytes an entry, 512 to 4096: tiny
    Shakespeare's train split (nanoGPT's 90%) gets the 1024 that measured best on it, the
    default corpus 4096."""
    assert auto_vocab_size(1_003_854) == 1024
    assert auto_vocab_size(0) == auto_vocab_size(20_000) == 512
    assert auto_vocab_size(1024 * BYTES_PER_ENTRY) == 1024
    assert auto_vocab_size(1024 * BYTES_PER_ENTRY - 1) == 512
    assert auto_vocab_size(12_000_000) == auto_vocab_size(10**12) == 4096
    sizes = [auto_vocab_size(n) for n in range(0, 8_000_000, 100_000)]
    assert sizes == sorted(sizes)


def test_tokenize_stage_with_auto_vocab_records_its_choice(tmp_path, caplog):
    data = tmp_path / "processed"
    data.mkdir()
    for name, text in {"train": TEXT, "val": TEXT[:3000], "test": TEXT[3000:6000]}.items():
        (data / f"{name}.txt").write_text(text)
    with caplog.at_level("INFO"):
        stats = tokenize(TokenizerConfig(), 64, data, tmp_path / "tok")
    assert TokenizerConfig().vocab_size == "auto"
    chosen = auto_vocab_size(len(TEXT.encode()))
    assert stats["auto.vocab_size"] == chosen and stats["vocab_size"] <= chosen
    assert f"auto chose tokenizer.vocab_size {chosen} for {len(TEXT.encode())} train bytes" in caplog.text


def test_tokenize_errors(tmp_path):
    with pytest.raises(LmopsError, match="run `lmops split` first"):
        tokenize(TokenizerConfig(), 64, tmp_path, tmp_path / "tok")
    with pytest.raises(LmopsError, match="run `lmops tokenize` first"):
        read_tokens(tmp_path / "tokens", "train")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    with pytest.raises(LmopsError, match="unreadable tokenizer"):
        load_tokenizer(tmp_path / "bad")
    assert not (tmp_path / "tok").exists()
