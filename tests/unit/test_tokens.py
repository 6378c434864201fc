"""The tokenize stage's token files: exact round trip, shards that lose and duplicate nothing,
parts that merge to the same ids, a SIGKILL midway then a rerun, and training across shards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from lmops.errors import LmopsError
from lmops.pipeline.params import TokenizerConfig
from lmops.pipeline.tokenize_stage import TrainingSample, encode_splits, merge, read_tokens, tokenize
from lmops.pipeline.train import batch
from lmops.runtime.tokenizer import encode, load_tokenizer

REPO = Path(__file__).resolve().parents[2]
LINES = [f"record {i}: {'ünï ' * (i % 5)}value={i * 7} ✓\n" for i in range(3000)]
SMALL = {"lmops.pipeline.tokenize_stage.CHUNK_CHARS": 300, "lmops.runtime.tokenizer.CHUNK_CHARS": 300}
CFG = TokenizerConfig(vocab_size=300, shard_bytes=2000)


def small_chunks():
    """Pieces of 300 characters and reads of 1 KB: many pieces, blocks and shards in a small corpus."""
    patches = [mock.patch(name, value) for name, value in SMALL.items()]
    patches.append(mock.patch("lmops.pipeline.tokenize_stage.READ_BYTES", 1000))
    for patch in patches:
        patch.start()
    return patches


@pytest.fixture
def data(tmp_path):
    d = tmp_path / "processed"
    d.mkdir()
    texts = {"train": "".join(LINES[:2400]), "val": "".join(LINES[2400:2700]), "test": "".join(LINES[2700:])}
    for name, text in texts.items():
        (d / f"{name}.txt").write_text(text)
    patches = small_chunks()
    yield d
    for patch in patches:
        patch.stop()


def test_token_files_decode_to_the_split_text_and_shards_lose_nothing(data, tmp_path):
    stats = tokenize(CFG, 64, data, tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    index = json.loads((data / "tokens/index.json").read_text())
    for name in ("train", "val", "test"):
        text = (data / f"{name}.txt").read_text()
        tokens = read_tokens(data / "tokens", name)
        ids = tokens[:]
        assert tok.decode(ids.tolist()) == text
        assert np.array_equal(ids, encode(tok, text))  # the ids of encoding the whole text
        shards = [
            np.fromfile(data / "tokens" / s["file"], dtype=np.uint16) for s in index["splits"][name]["shards"]
        ]
        assert all(len(s) <= 1000 for s in shards) and np.array_equal(np.concatenate(shards), ids)
        for start in (0, 999, 1000, 1001, len(ids) - 5):  # windows across shard boundaries
            assert np.array_equal(tokens[start : start + 5], ids[start : start + 5])
    assert stats["splits"]["train"]["shards"] == len(index["splits"]["train"]["shards"]) > 3


def test_parts_merge_to_the_same_ids(data, tmp_path):
    tokenize(CFG, 64, data, tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    parts = [encode_splits(tok, CFG, data, tmp_path / "parts" / str(k), k, 3) for k in (2, 0, 1)]
    assert all(p["parts"] == 3 for p in parts)
    merge([tmp_path / "parts" / str(k) for k in (1, 2, 0)], tmp_path / "merged")
    for name in ("train", "val", "test"):
        assert np.array_equal(
            read_tokens(tmp_path / "merged", name)[:], read_tokens(data / "tokens", name)[:]
        )
    with pytest.raises(LmopsError, match=r"need parts 0..2, found 0, 2"):
        merge([tmp_path / "parts" / "0", tmp_path / "parts" / "2"], tmp_path / "bad")


def test_training_sample_is_bounded_seeded_whole_lines(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("".join(LINES) * 10)  # ~1 MB
    sample = TrainingSample(path, 200_000, seed=1)
    pieces = list(sample)
    assert sample.bytes <= 200_000 and sample.bytes > 150_000
    assert all(p.endswith("\n") and p.splitlines()[0] + "\n" in LINES for p in pieces)
    assert (
        pieces == list(TrainingSample(path, 200_000, seed=1)) != list(TrainingSample(path, 200_000, seed=2))
    )


def _tokenize_in_subprocess(data: Path, tok: Path, env: dict) -> subprocess.CompletedProcess:
    code = (
        "import sys; from unittest import mock; from pathlib import Path;"
        "from lmops.pipeline.params import TokenizerConfig; from lmops.pipeline.tokenize_stage import tokenize;"
        f"[mock.patch(n, v).start() for n, v in {SMALL!r}.items()];"
        "tokenize(TokenizerConfig(vocab_size=300, shard_bytes=2000), 64, Path(sys.argv[1]), Path(sys.argv[2]))"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(data), str(tok)], env={**os.environ, **env}, capture_output=True
    )


def test_sigkill_during_tokenize_then_rerun_gives_identical_outputs(data, tmp_path):
    straight = _tokenize_in_subprocess(data, tmp_path / "tok", {})
    assert straight.returncode == 0, straight.stderr
    expected = {p.name: p.read_bytes() for p in (data / "tokens").iterdir() if p.name != "index.json"}
    (data / "tokens").rename(tmp_path / "straight")
    killed = _tokenize_in_subprocess(data, tmp_path / "tok", {"LMOPS_TEST_SIGKILL_AT": "tokenize.shard:3"})
    assert killed.returncode == -9
    assert not (data / "tokens").exists()  # no shard, no index looks finished
    assert [p.name for p in data.iterdir() if p.name.startswith(".tokens.")]  # what it left, hidden
    rerun = _tokenize_in_subprocess(data, tmp_path / "tok", {})
    assert rerun.returncode == 0, rerun.stderr
    assert {p.name: p.read_bytes() for p in (data / "tokens").iterdir() if p.name != "index.json"} == expected
    assert [p.name for p in data.iterdir() if p.name.startswith(".")] == []  # the leftovers are gone


def test_training_batches_across_shards_are_those_of_one_flat_array(data, tmp_path):
    """Windows that span two shards included, over two epochs (test_train pins what an epoch
    of windows covers)."""
    tokenize(CFG, 64, data, tmp_path / "tok")
    tokens = read_tokens(data / "tokens", "train")
    flat = tokens[:].astype(np.int64)
    per_epoch = (len(flat) - 1) // 64 - 1
    assert per_epoch > 32 and len(list((data / "tokens").glob("train-*.bin"))) > 1
    for first in range(0, 2 * per_epoch, 16):
        x, y = batch(tokens, 64, 16, 1337, first, torch.device("cpu"))
        fx, fy = batch(flat, 64, 16, 1337, first, torch.device("cpu"))
        assert torch.equal(x, fx) and torch.equal(y, fy)
