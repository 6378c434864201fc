"""get_data's documents and the split: units, the size cap, split methods, duplicates, the report."""

import functools
import json
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from lmops.errors import LmopsError
from lmops.pipeline.data import (
    Cap,
    _chunks,
    _lines,
    _paragraphs,
    assign_splits,
    get_data,
    read_documents,
    split,
)
from lmops.pipeline.params import DataConfig, SplitConfig
from lmops.pipeline.sources import FILE_HEADER, stdlib_files
from tests.unit.data_reference import reference_split

SHAKESPEARE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tinyshakespeare.txt"


def write_corpus(raw: Path, docs: list[str], slices: list[str] | None = None) -> None:
    """What get_data writes, for split tests that choose their own documents (and their
    slices: all in one by default)."""
    raw.mkdir(parents=True, exist_ok=True)
    encoded = [d.encode() for d in docs]
    (raw / "corpus.txt").write_bytes(b"".join(encoded))
    (raw / "doc_offsets.bin").write_bytes(np.cumsum([len(e) for e in encoded]).astype("<u8").tobytes())
    slices = slices or [""] * len(docs)
    names = list(dict.fromkeys(slices))
    (raw / "doc_slices.bin").write_bytes(np.array([names.index(s) for s in slices], dtype="<u2").tobytes())
    (raw / "slices.json").write_text(json.dumps({"slice_by": None, "slices": names}))


def split_texts(out: Path) -> dict[str, str]:
    return {n: (out / f"{n}.txt").read_text() for n in ("train", "val", "test")}


@functools.cache
def _stdlib_names() -> list[str]:
    return [name for name, _ in stdlib_files()]


def test_stdlib_source_is_sorted_offline_and_has_no_tests(tmp_path):
    names = [n.removeprefix("python-stdlib/") for n in _stdlib_names()]
    assert names == sorted(names) and len(names) > 300
    assert not [n for n in names if "/test/" in f"/{n}" or n.split("/")[-1].startswith("test_")]
    assert "os.py" in names and "json/decoder.py" in names
    manifest = get_data(DataConfig(max_bytes=200_000), tmp_path)
    assert manifest["document_unit"] == "file" and manifest["capped"] and manifest["bytes"] <= 200_000
    assert manifest["files"] == _stdlib_names()[: len(manifest["files"])]  # read in order, stopped at the cap
    docs = list(read_documents(tmp_path))
    assert len(docs) == manifest["documents"] and all(d.startswith(FILE_HEADER) for d in docs)
    assert all(d.endswith("\n\n") and not d.endswith("\n\n\n") for d in docs[:-1])  # the last may be cut
    assert get_data(DataConfig(max_bytes=200_000), tmp_path / "again")["sha256"] == manifest["sha256"]


def test_pieces_of_a_text():
    text = "a\nb\n\nc\n\n\nd\r\n\r\ne\x0cf\nlast"
    assert _lines(text) == ["a\n", "b\n", "\n", "c\n", "\n", "\n", "d\r\n", "\r\n", "e\x0cf\n", "last"]
    assert list(_paragraphs(_lines(text))) == ["a\nb\n\n", "c\n\n\n", "d\r\n\r\n", "e\x0cf\nlast"]
    assert list(_chunks(_lines("aaaa\nbb\ncc\n" + "x" * 20 + "\nd\n"), 8)) == [
        "aaaa\nbb\n",
        "cc\n",
        "x" * 20 + "\n",
        "d\n",
    ]


@pytest.mark.parametrize(
    ("unit", "expected"),
    [
        ("paragraph", ["one\ntwo\n\n", "three\n"]),
        ("line", ["one\n", "two\n", "three\n"]),  # the blank line is an empty document, dropped
        ("chunk", ["one\ntwo\n\n", "three\n"]),
        ("file", ["one\ntwo\n\nthree\n\n"]),
    ],
)
def test_units_of_a_text_file(tmp_path, unit, expected):
    (tmp_path / "c.txt").write_text("one\ntwo\n\nthree")
    manifest = get_data(
        DataConfig(source=str(tmp_path / "c.txt"), document_unit=unit, chunk_bytes=9), tmp_path / "raw"
    )
    assert list(read_documents(tmp_path / "raw")) == expected
    assert manifest["document_unit"] == unit and manifest["empty_documents_dropped"] == (unit == "line")


def test_auto_unit(tmp_path):
    (tmp_path / "para.txt").write_text("p1\n\np2\n\np3\n")
    (tmp_path / "lines.txt").write_text("".join(f"sentence {i}.\n" for i in range(100)))
    cfg = {"chunk_bytes": 200}
    assert (
        get_data(DataConfig(source=str(tmp_path / "para.txt"), **cfg), tmp_path / "a")["document_unit"]
        == "paragraph"
    )
    manifest = get_data(DataConfig(source=str(tmp_path / "lines.txt"), **cfg), tmp_path / "b")
    assert (
        manifest["document_unit"] == "chunk" and manifest["documents"] == 7
    )  # 1290 bytes in 200-byte chunks of lines
    assert (tmp_path / "b/corpus.txt").read_text() == (tmp_path / "lines.txt").read_text()
    assert get_data(DataConfig(source=str(tmp_path / "*.txt")), tmp_path / "c")["document_unit"] == "file"
    (tmp_path / "t.jsonl").write_text('{"text": "x"}\n{"text": "y"}\n')
    assert get_data(DataConfig(source=str(tmp_path / "t.jsonl")), tmp_path / "d")["document_unit"] == "row"
    with pytest.raises(LmopsError, match="document_unit: row needs a table"):
        get_data(DataConfig(source=str(tmp_path / "para.txt"), document_unit="row"), tmp_path / "e")


def test_rows_can_be_cut_into_paragraphs(tmp_path):
    (tmp_path / "books.jsonl").write_text(
        json.dumps({"text": "a\n\nb"}) + "\n" + json.dumps({"text": "c"}) + "\n"
    )
    get_data(DataConfig(source=str(tmp_path / "books.jsonl"), document_unit="paragraph"), tmp_path / "raw")
    assert list(read_documents(tmp_path / "raw")) == ["a\n\n", "b\n", "c\n"]


def cap_documents(docs: list[str], max_bytes: int | None) -> tuple[list[str], bool]:
    cap = Cap(max_bytes)
    return [d.decode() for d, _ in cap.apply((d, None) for d in docs)], cap.cut


def test_cap_ends_at_a_document_boundary():
    docs = ["aaaa\n", "bbbbbbbbb\n", "cc\n"]
    assert cap_documents(docs, 12) == (["aaaa\n"], True)  # never skips ahead to smaller documents
    assert cap_documents(docs, None) == (docs, False)
    assert cap_documents(docs, 100) == (docs, False)


def test_cap_cuts_inside_a_document_larger_than_the_cap():
    big = "".join(f"line {i}\n" for i in range(1000))
    assert cap_documents(["ab\n", big], 50) == (
        ["ab\n", "line 0\nline 1\nline 2\nline 3\nline 4\nline 5\n"],
        True,
    )
    # a single line larger than the budget: cut at a character (not inside a UTF-8 sequence)
    kept, capped = cap_documents(["é" * 100], 9)
    assert kept == ["éééé"] and capped


def test_issue_corpora_one_sentence_per_line(tmp_path):
    """The two corpora of the issue: no blank lines, 400 KB, and 4 MB capped to 400 KB."""
    lines = [f"This is sentence number {i} of a corpus with one record per line.\n" for i in range(60_000)]
    (tmp_path / "small.txt").write_text("".join(lines[:6000]))
    (tmp_path / "big.txt").write_text("".join(lines))
    for name, max_bytes in (("small.txt", None), ("big.txt", 400_000)):
        raw, out = tmp_path / f"{name}-raw", tmp_path / f"{name}-out"
        manifest = get_data(DataConfig(source=str(tmp_path / name), max_bytes=max_bytes), raw)
        assert manifest["document_unit"] == "chunk" and manifest["documents"] > 90
        report = split(SplitConfig(), 64, raw, out, tmp_path / f"{name}-report.json")
        assert min(report["split"][s]["documents"] for s in ("train", "val", "test")) >= 4
    assert 400_000 - 4096 < manifest["bytes"] <= 400_000 and manifest["capped"]  # a chunk boundary


def test_max_bytes_inside_one_huge_document(tmp_path):
    (tmp_path / "one.txt").write_text("".join(f"row {i}\n" for i in range(100_000)))
    manifest = get_data(
        DataConfig(source=str(tmp_path / "one.txt"), document_unit="file", max_bytes=5000), tmp_path / "raw"
    )
    text = (tmp_path / "raw/corpus.txt").read_text()
    assert manifest["documents"] == 1 and 4990 < len(text) <= 5000 and text.endswith("\n")
    assert (tmp_path / "one.txt").read_text().startswith(text)


def test_random_split_is_deterministic_disjoint_and_complete(tmp_path):
    docs = [f"doc {i}\n\n" for i in range(200)]
    write_corpus(tmp_path / "raw", docs)
    cfg = SplitConfig(val_fraction=0.1, test_fraction=0.05, seed=7)
    report = split(cfg, 1, tmp_path / "raw", tmp_path / "out", tmp_path / "report.json")
    assert {k: report["split"][k]["documents"] for k in ("train", "val", "test")} == {
        "val": 20,
        "test": 10,
        "train": 170,
    }
    parts = split_texts(tmp_path / "out")
    seen = [d for p in parts.values() for d in p.split("\n\n") if d]
    assert sorted(seen) == sorted(d.strip() for d in docs)  # every document exactly once
    again = assign_splits([1] * 200, cfg)
    assert parts["test"] == "".join(docs[i] for i in again["test"])
    other = assign_splits([1] * 200, SplitConfig(val_fraction=0.1, test_fraction=0.05, seed=8))
    assert list(other["test"]) != list(again["test"])


def test_a_split_made_lopsided_by_one_huge_document_is_a_warning_with_the_fix(tmp_path, caplog):
    small = [f"doc {i}\n\n" for i in range(40)]
    cfg = SplitConfig(val_fraction=0.1, test_fraction=0.1, seed=0)
    write_corpus(tmp_path / "raw", small)
    with caplog.at_level("WARNING", logger="lmops.pipeline.data"):
        split(cfg, 1, tmp_path / "raw", tmp_path / "out", tmp_path / "report.json")
    assert not caplog.records  # documents of one size: the shares follow the fractions
    huge = "x" * 200 + "\n"
    write_corpus(tmp_path / "raw", small + [huge * 100 + "\n"])  # one record 98% of the bytes
    with caplog.at_level("WARNING", logger="lmops.pipeline.data"):
        report = split(cfg, 1, tmp_path / "raw", tmp_path / "out", tmp_path / "report.json")
    shares = " / ".join(
        f"{n} {100 * report['split'][n]['bytes'] / report['bytes']:.1f}%" for n in ("train", "val", "test")
    )
    assert [r.getMessage() for r in caplog.records] == [
        f"the splits hold {shares} of the corpus bytes, not 80% / 10% / 10%: splits are drawn by document "
        "and the largest document is 98.5% of the corpus; cut documents smaller with "
        "data.document_unit: chunk (and data.chunk_bytes)"
    ]


def test_tail_split_cuts_source_order_at_byte_fractions(tmp_path):
    docs = [f"doc {i:03d}\n" + "x" * (i % 7) + "\n\n" for i in range(300)]
    write_corpus(tmp_path / "raw", docs)
    cfg = SplitConfig(method="tail", val_fraction=0.1, test_fraction=0.05)
    split(cfg, 1, tmp_path / "raw", tmp_path / "out", tmp_path / "report.json")
    parts = split_texts(tmp_path / "out")
    assert parts["train"] + parts["val"] + parts["test"] == "".join(docs)  # source order, nothing lost
    total = len("".join(docs))
    assert abs(len(parts["val"]) - 0.1 * total) <= 16 and abs(len(parts["test"]) - 0.05 * total) <= 16
    # the seed plays no part: the same cut every time
    again = assign_splits(
        [len(d) for d in docs], SplitConfig(method="tail", val_fraction=0.1, test_fraction=0.05, seed=9)
    )
    assert parts["test"] == "".join(docs[i] for i in again["test"])


def test_tail_split_gives_every_split_a_document():
    sizes = [1000, 1, 1, 1]  # byte fractions alone would leave val and test empty
    got = assign_splits(sizes, SplitConfig(method="tail", val_fraction=0.01, test_fraction=0.01))
    assert {k: list(v) for k, v in got.items()} == {"train": [0], "val": [1], "test": [2, 3]}


@pytest.mark.skipif(not SHAKESPEARE.is_file(), reason="shared tiny Shakespeare absent")
def test_tail_split_is_nanogpts_split_on_tiny_shakespeare():
    """train = the file's first 90% (nanoGPT: data[:int(n * 0.9)]) to within one paragraph."""
    text = SHAKESPEARE.read_text()
    docs = list(_paragraphs(_lines(text)))
    got = assign_splits(
        [len(d) for d in docs], SplitConfig(method="tail", val_fraction=0.05, test_fraction=0.05)
    )
    train = "".join(docs[i] for i in got["train"])
    assert text.startswith(train) and abs(len(train) - int(len(text) * 0.9)) < 100


@pytest.mark.parametrize(("method", "dropped"), [("random", 0), ("tail", 2)])
def test_duplicates_never_land_in_two_splits(tmp_path, method, dropped):
    docs = [f"doc {i}\n\n" for i in range(100)]
    docs += [" doc  3 \n\n", "doc 50\n\n", "doc 99\n\n", "doc 99\n\n"]  # whitespace-normalised copies
    write_corpus(tmp_path / "raw", docs)
    cfg = SplitConfig(method=method, val_fraction=0.2, test_fraction=0.2)
    report = split(cfg, 1, tmp_path / "raw", tmp_path / "out", tmp_path / "report.json")
    assert report["documents"] == 104 and report["duplicates_merged"] == 4
    # random deals each copy with its first; tail drops the copies of doc 3 and doc 50 (in train) from test
    assert report["duplicates_dropped"] == dropped
    assert sum(report["split"][s]["documents"] for s in ("train", "val", "test")) == 104 - dropped
    keys = {
        n: {" ".join(d.split()) for d in t.split("\n\n") if d}
        for n, t in split_texts(tmp_path / "out").items()
    }
    assert not (keys["train"] & keys["val"] or keys["train"] & keys["test"] or keys["val"] & keys["test"])
    assert set.union(*keys.values()) == {f"doc {i}" for i in range(100)}
    assert json.loads((tmp_path / "report.json").read_text()) == report


def test_tail_split_empty_after_merging_duplicates(tmp_path):
    write_corpus(tmp_path / "raw", [f"doc {i}\n" for i in range(20)] + ["doc 1\n"] * 3)
    cfg = SplitConfig(method="tail", val_fraction=0.1, test_fraction=0.05)
    with pytest.raises(
        LmopsError, match="split 'test' would be empty: its 1 document.s. all copy documents of an"
    ):
        split(cfg, 1, tmp_path / "raw", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_data_report(tmp_path):
    (tmp_path / "c.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in ["a" * 10, "", "a" * 10, "b" * 30, "  ", "c" * 50])
    )
    get_data(DataConfig(source=str(tmp_path / "c.jsonl")), tmp_path / "raw")
    report = split(
        SplitConfig(method="tail", val_fraction=0.3, test_fraction=0.3),
        1,
        tmp_path / "raw",
        tmp_path / "out",
        tmp_path / "r.json",
    )
    assert report["empty_documents_dropped"] == 2 and report["duplicates_merged"] == 1
    assert (
        report["duplicates_dropped"] == 0 and report["split"]["train"]["documents"] == 2
    )  # copies in one split
    assert report["documents"] == 4 and report["bytes"] == 12 + 32 + 52 + 12 and report["files"] == 1
    assert report["document_bytes"] == {
        "min": 12,
        "p10": 12,
        "p50": 22,
        "p90": 46,
        "p99": 51,
        "max": 52,
        "mean": 27.0,
    }
    assert report["split"]["method"] == "tail" and report["split"]["test"] == {"documents": 1, "bytes": 52}
    headline = json.loads((tmp_path / "data_metrics.json").read_text())
    assert headline == {"documents": 4, "bytes": 108, "duplicates_merged": 1, "empty_documents_dropped": 2}


@pytest.mark.parametrize(
    ("docs", "max_seq_len", "fraction", "needle"),
    [
        (["one one\n", "two two\n"], 1, 0.3, r"corpus has 2 distinct document\(s\); need at least 3"),
        (["same\n"] * 5, 1, 0.3, r"corpus has 1 distinct document"),
        (
            [f"d{i}\n" for i in range(10)],
            64,
            0.3,
            r"too small to train on: 30 bytes; the minimum is .* = 198 bytes",
        ),
        (["x" * 500 + "\n", "y\n", "z\n"], 64, 0.3, r"split '\w+' has 2 bytes, too small to train on.* = 66"),
        (
            [f"d{i}\n" for i in range(4)],
            1,
            0.45,
            r"split 'train' would be empty: 4 distinct documents are too few",
        ),
    ],
)
def test_split_refuses_what_cannot_train_and_writes_nothing(tmp_path, docs, max_seq_len, fraction, needle):
    write_corpus(tmp_path / "raw", docs)
    cfg = SplitConfig(val_fraction=fraction, test_fraction=fraction)
    with pytest.raises(LmopsError, match=needle):
        split(cfg, max_seq_len, tmp_path / "raw", tmp_path / "out", tmp_path / "r.json")
    assert not (tmp_path / "out").exists() and not (tmp_path / "r.json").exists()


def test_split_needs_get_data_first(tmp_path):
    with pytest.raises(LmopsError, match="run `lmops get_data` first"):
        split(SplitConfig(), 1, tmp_path / "nothing", tmp_path / "out")
    write_corpus(tmp_path / "raw", ["a\n", "b\n", "c\n"])
    (tmp_path / "raw/corpus.txt").write_text("a\nb\n")
    with pytest.raises(LmopsError, match="does not match .*run `lmops get_data` again"):
        split(SplitConfig(), 1, tmp_path / "raw", tmp_path / "out")


@pytest.mark.parametrize("method", ["random", "tail"])
def test_streaming_split_equals_the_in_memory_reference(tmp_path, method):
    """Random documents with many whitespace-normalised copies, in blocks smaller than the
    corpus: the same splits and the same dedup as the in-memory split."""
    rng = np.random.default_rng(3)
    words = ["alpha", "beta", "gamma", "delta", "é", "日本", "x" * 40]
    docs = []
    for _ in range(3000):
        if docs and rng.random() < 0.2:  # a copy, respaced
            docs.append(" " + docs[int(rng.integers(len(docs)))].replace(" ", "  "))
        else:
            docs.append(" ".join(rng.choice(words, int(rng.integers(1, 30)))) + "\n")
    write_corpus(tmp_path / "raw", docs)
    cfg = SplitConfig(method=method, val_fraction=0.1, test_fraction=0.1, seed=5)
    expected, first = reference_split(tmp_path / "raw", cfg)
    with (
        mock.patch("lmops.pipeline.data.READ_BYTES", 4096),
        mock.patch("lmops.pipeline.data.WRITE_BYTES", 1000),
    ):
        report = split(cfg, 8, tmp_path / "raw", tmp_path / "out", tmp_path / "r.json")
    assert split_texts(tmp_path / "out") == expected
    assert report["duplicates_merged"] == int((first != np.arange(len(first))).sum()) > 500
