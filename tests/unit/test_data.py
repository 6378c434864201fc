import functools
import hashlib
import http.server
import threading
from pathlib import Path

import pytest

from lmops.config import DataConfig, SplitConfig
from lmops.data import FILE_HEADER, assign_splits, cap_documents, documents, get_data, split, stdlib_corpus
from lmops.errors import LmopsError

SHAKESPEARE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tinyshakespeare.txt"


@functools.cache
def _stdlib() -> str:
    return stdlib_corpus().decode("utf-8")


def test_stdlib_corpus_is_sorted_offline_and_has_no_tests():
    text = _stdlib()
    names = [line[len(FILE_HEADER) :] for line in text.splitlines() if line.startswith(FILE_HEADER)]
    assert names == sorted(names)
    assert len(names) > 300 and 5_000_000 < len(text) < 20_000_000
    assert not [n for n in names if "/test/" in f"/{n}" or n.split("/")[-1].startswith("test_")]
    assert "os.py" in names and "json/decoder.py" in names
    assert stdlib_corpus().decode() == text  # deterministic


def test_documents_round_trip():
    docs = documents(_stdlib()[:300_000])
    assert "".join(docs) == _stdlib()[:300_000]
    assert all(d.startswith(FILE_HEADER) for d in docs)
    paragraphs = documents("a\nb\n\nc\n\n\nd\n")
    assert paragraphs == ["a\nb\n\n", "c\n\n\n", "d\n"]


def test_cap_keeps_whole_documents_within_budget():
    docs = ["aaaa", "bbbbbbbbbb", "cc", "d"]
    assert cap_documents(docs, 7) == ["aaaa", "cc", "d"]
    assert cap_documents(docs, None) == docs
    with pytest.raises(LmopsError, match="smaller than every document"):
        cap_documents(["aaaa"], 2)


def test_get_data_local_file_and_manifest(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text("one\n\ntwo\n\nthree\n")
    for source in (str(src), src.as_uri()):
        manifest = get_data(DataConfig(source=source), tmp_path / "raw")
        assert manifest["documents"] == 3 and manifest["bytes"] == src.stat().st_size
        assert manifest["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
        assert (tmp_path / "raw" / "corpus.txt").read_bytes() == src.read_bytes()


def test_get_data_over_real_http(tmp_path):
    (tmp_path / "c.txt").write_text("alpha\n\nbeta\n\ngamma\n")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert get_data(DataConfig(source=f"{base}/c.txt"), tmp_path / "raw")["documents"] == 3
        with pytest.raises(LmopsError, match="could not fetch.*404"):
            get_data(DataConfig(source=f"{base}/missing.txt"), tmp_path / "raw2")
    finally:
        server.shutdown()
    assert not (tmp_path / "raw2").exists()  # nothing half-written


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"", "corpus is empty"),
        (b"  \n\n ", "corpus is empty"),
        (b"good line\nbad \xff byte\n", r"not UTF-8: byte 0xff at offset 14 \(line 2, column 5\)"),
    ],
)
def test_bad_corpus_is_rejected_and_nothing_written(tmp_path, content, needle):
    src = tmp_path / "c.txt"
    src.write_bytes(content)
    with pytest.raises(LmopsError, match=needle):
        get_data(DataConfig(source=str(src)), tmp_path / "raw")
    assert not (tmp_path / "raw").exists()


def test_source_errors(tmp_path):
    with pytest.raises(LmopsError, match="no such file"):
        get_data(DataConfig(source=str(tmp_path / "absent.txt")), tmp_path)
    with pytest.raises(LmopsError, match="unsupported source 'ftp://x'"):
        get_data(DataConfig(source="ftp://x"), tmp_path)
    src = tmp_path / "c.txt"
    src.write_text("a\n\nb\n")
    with pytest.raises(LmopsError, match="sha256 mismatch"):
        get_data(DataConfig(source=str(src), sha256="0" * 64), tmp_path / "raw")
    assert not (tmp_path / "raw").exists()


def test_split_is_deterministic_disjoint_and_complete(tmp_path):
    docs = [f"doc {i}\n\n" for i in range(200)]
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "corpus.txt").write_text("".join(docs))
    cfg = SplitConfig(val_fraction=0.1, test_fraction=0.05, seed=7)
    stats = split(cfg, tmp_path / "raw", tmp_path / "out")
    assert {k: v["documents"] for k, v in stats.items()} == {"val": 20, "test": 10, "train": 170}
    parts = {n: documents((tmp_path / "out" / f"{n}.txt").read_text()) for n in ("train", "val", "test")}
    seen = [d for p in parts.values() for d in p]
    assert sorted(seen) == sorted(docs)  # every document exactly once
    again = assign_splits([1] * 200, cfg)
    assert [d for d in parts["test"]] == [docs[i] for i in again["test"]]
    other = assign_splits([1] * 200, SplitConfig(val_fraction=0.1, test_fraction=0.05, seed=8))
    assert list(other["test"]) != list(again["test"])


def test_tail_split_cuts_source_order_at_byte_fractions(tmp_path):
    docs = [f"doc {i:03d}\n" + "x" * (i % 7) + "\n\n" for i in range(300)]
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "corpus.txt").write_text("".join(docs))
    cfg = SplitConfig(method="tail", val_fraction=0.1, test_fraction=0.05)
    split(cfg, tmp_path / "raw", tmp_path / "out")
    parts = {n: (tmp_path / "out" / f"{n}.txt").read_text() for n in ("train", "val", "test")}
    assert parts["train"] + parts["val"] + parts["test"] == "".join(docs)  # source order, nothing lost
    total = len("".join(docs))
    assert abs(len(parts["val"]) - 0.1 * total) <= 16 and abs(len(parts["test"]) - 0.05 * total) <= 16
    assert parts["test"].endswith(docs[-1]) and parts["train"].startswith(docs[0])
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
    """val + test = the file's last 10% (nanoGPT: data[int(n * 0.9):]) to within one paragraph."""
    text = SHAKESPEARE.read_text()
    docs = documents(text)
    got = assign_splits(
        [len(d) for d in docs], SplitConfig(method="tail", val_fraction=0.05, test_fraction=0.05)
    )
    heldout = "".join(docs[i] for i in got["val"]) + "".join(docs[i] for i in got["test"])
    assert text.endswith(heldout)
    assert abs(len(text) - len(heldout) - int(len(text) * 0.9)) < 100


def test_split_needs_enough_documents(tmp_path):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "corpus.txt").write_text("only\n\ntwo\n")
    with pytest.raises(LmopsError, match="need at least 3"):
        split(SplitConfig(), tmp_path / "raw", tmp_path / "out")
    with pytest.raises(LmopsError, match="run `lmops get_data` first"):
        split(SplitConfig(), tmp_path / "nothing", tmp_path / "out")
