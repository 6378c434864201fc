import math

import numpy as np
import pytest
import torch

from lmops.errors import LmopsError
from lmops.pipeline.evaluate import (
    Unit,
    read_units,
    score,
    score_units,
    select_units,
    split_units,
    summarize,
    units_csv,
)
from lmops.pipeline.tokenize_stage import train_tokenizer
from lmops.runtime.model import Llama
from lmops.runtime.model_config import LlamaConfig
from lmops.runtime.tokenizer import chunks, encode, token_byte_lengths

TEXT = "".join(f"print('line {i} → ok')\n" for i in range(300))
SHAPE = {"n_layer": 1, "n_head": 2, "n_kv_heads": 1, "n_embd": 16, "intermediate_size": 32}


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([TEXT], vocab_size=300)


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=tok.get_vocab_size(), max_seq_len=16, **SHAPE)).eval()


def test_uniform_model_scores_log_vocab_nats_per_token(tok):
    model = Llama(LlamaConfig(vocab_size=tok.get_vocab_size(), max_seq_len=32, tie_embeddings=False, **SHAPE))
    model.eval()
    torch.nn.init.zeros_(model.lm_head.weight)  # every logit 0: a uniform distribution
    result = score(model, tok, chunks(TEXT), batch_size=4)
    ids = encode(tok, TEXT)
    n_bytes = int(token_byte_lengths(tok)[ids[1:]].sum())  # every token but the first is predicted
    assert result["tokens"] == len(ids) - 1 and result["bytes"] == n_bytes and result["units"] == 1
    assert result["loss"] == pytest.approx(math.log(tok.get_vocab_size()), rel=1e-5)
    assert result["perplexity"] == pytest.approx(tok.get_vocab_size(), rel=1e-4)
    assert result["bits_per_byte"] == pytest.approx(result["tokens"] * math.log2(300) / n_bytes, rel=1e-5)


def test_units_are_whole_lines_that_tile_the_split(tmp_path):
    path = tmp_path / "test.txt"
    path.write_text(TEXT + "x" * 1000, encoding="utf-8")  # ends in one long line, no newline
    units = list(split_units(path, 200))
    assert "".join(u.text for u in units) == path.read_text(encoding="utf-8")
    assert [u.index for u in units] == list(range(len(units)))
    offsets = np.cumsum([0] + [len(u.text.encode()) for u in units[:-1]])
    assert [u.offset for u in units] == offsets.tolist()
    assert all(u.text.endswith("\n") and len(u.text.encode()) >= 200 for u in units[:-3])
    assert max(len(u.text) for u in units[-3:]) <= 4 * 200  # the long line is cut, memory bounded


def test_the_sample_is_all_units_or_one_from_each_stretch():
    assert select_units(10, 20, seed=1).tolist() == list(range(10))
    assert select_units(10, None, seed=1).tolist() == list(range(10))
    picked = select_units(1000, 50, seed=1)
    assert len(picked) == 50 and np.all(np.diff(picked) > 0)
    assert np.all(picked // 20 == np.arange(50))  # one from each twentieth of the split
    assert picked.tolist() == select_units(1000, 50, seed=1).tolist()
    assert picked.tolist() != select_units(1000, 50, seed=2).tolist()


def test_each_unit_is_scored_alone_however_the_batch_pads(model, tok):
    texts = [TEXT[:200], TEXT[200:1500], TEXT[1500:1540]]
    units = [Unit(i, 0, t) for i, t in enumerate(texts)]
    together = score_units(model, tok, units, batch_size=5)
    alone = [score_units(model, tok, [u], batch_size=1)[0] for u in units]
    for a, b in zip(together, alone, strict=True):
        assert (a["unit"], a["tokens"], a["bytes"]) == (b["unit"], b["tokens"], b["bytes"])
        assert a["nll_bits"] == pytest.approx(b["nll_bits"], rel=1e-5)
    whole = summarize(together)
    assert whole["units"] == 3 and whole["tokens"] == sum(r["tokens"] for r in together)
    assert whole["bits_per_byte"] == pytest.approx(
        sum(r["nll_bits"] for r in together) / sum(r["bytes"] for r in together)
    )


def test_unit_results_round_trip_and_a_damaged_file_is_one_error(model, tok, tmp_path):
    rows = score_units(model, tok, [Unit(0, 0, TEXT[:300]), Unit(4, 300, TEXT[300:900])], batch_size=2)
    path = tmp_path / "units.csv"
    path.write_text(units_csv(rows))
    back = read_units(path)
    assert [(r["unit"], r["offset"], r["tokens"], r["bytes"]) for r in back] == [
        (r["unit"], r["offset"], r["tokens"], r["bytes"]) for r in rows
    ]
    assert [r["nll_bits"] for r in back] == pytest.approx([r["nll_bits"] for r in rows])
    path.write_text("unit,tokens\n1,2\n")
    with pytest.raises(LmopsError, match=r"units\.csv: unreadable unit results"):
        read_units(path)


def test_score_refuses_a_str(model, tok):
    with pytest.raises(TypeError, match="not a str"):
        score(model, tok, TEXT)
