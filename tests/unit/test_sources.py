"""Sources and formats: files, directories, globs, URLs, text/JSONL/CSV/TSV/Parquet, .gz/.zst."""

import functools
import gzip
import hashlib
import http.server
import io
import json
import threading

import pandas as pd
import pytest
import zstandard

from lmops.errors import LmopsError
from lmops.pipeline import sources
from lmops.pipeline.data import get_data, read_documents
from lmops.pipeline.params import DataConfig

ROWS = ["first row,\nwith a newline", 'second "quoted" row', "third row\tand a tab"]


def get(tmp_path, source, **cfg):
    return get_data(DataConfig(source=str(source), **cfg), tmp_path / "raw")


def docs(tmp_path):
    return list(read_documents(tmp_path / "raw"))


def rows_as_docs(rows=ROWS):
    return [r + "\n\n" for r in rows]


def write_table(path, rows=ROWS, field="text"):
    """`path` in the format its extension names, with an extra `id` column."""
    frame = pd.DataFrame({"id": range(len(rows)), field: rows})
    plain = path.name.removesuffix(".gz").removesuffix(".zst")
    if plain.endswith(".jsonl"):
        data = frame.to_json(orient="records", lines=True).encode()
    elif plain.endswith(".csv"):
        data = frame.to_csv(index=False).encode()
    elif plain.endswith(".tsv"):
        data = frame.to_csv(index=False, sep="\t").encode()
    else:
        frame.to_parquet(path.with_suffix(".tmp"))
        data = path.with_suffix(".tmp").read_bytes()
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    elif path.name.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    "name",
    ["c.jsonl", "c.csv", "c.tsv", "c.parquet", "c.jsonl.gz", "c.csv.zst", "c.tsv.gz", "c.parquet.zst"],
)
def test_tables_give_one_document_per_row(tmp_path, name):
    manifest = get(tmp_path, write_table(tmp_path / name))
    assert docs(tmp_path) == rows_as_docs()
    assert manifest["document_unit"] == "row" and manifest["documents"] == 3


class ReadCounter(io.BytesIO):
    """A file that counts the bytes read from it (Parquet's footer is at the end: a
    reader seeks there first, so only the count tells how much was read)."""

    total = 0

    def read(self, size=-1):
        data = super().read(size)
        ReadCounter.total += len(data)
        return data

    def readinto(self, buffer):
        n = super().readinto(buffer)
        ReadCounter.total += n
        return n


@pytest.mark.parametrize("name", ["big.csv", "big.parquet", "big.parquet.gz"])
def test_tables_are_read_as_they_are_consumed(tmp_path, monkeypatch, name):
    """A table is never held whole: its first row arrives before most of the file is read."""
    monkeypatch.setattr(sources, "TABLE_ROWS", 500)
    rows = [f"row {i} " + hashlib.sha256(str(i).encode()).hexdigest() * 4 for i in range(20_000)]
    path = tmp_path / name
    if "parquet" in name:
        pd.DataFrame({"text": rows}).to_parquet(tmp_path / "plain.parquet", row_group_size=1000)
        data = (tmp_path / "plain.parquet").read_bytes()
        path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    else:
        write_table(path, rows)
    size = len(gzip.decompress(path.read_bytes())) if name.endswith(".gz") else path.stat().st_size
    ReadCounter.total = 0
    file = sources.read_file(name, lambda: ReadCounter(path.read_bytes()), DataConfig(source=str(path)))
    texts = file.texts()
    assert "".join(next(texts)[0]) == rows[0]
    if not name.endswith(".gz"):  # a compressed Parquet file is decompressed to disk first
        assert ReadCounter.total < size / 4, (ReadCounter.total, size)
    assert ["".join(t) for t, _ in texts] == rows[1:]


def test_text_field_and_explicit_format(tmp_path):
    write_table(tmp_path / "c.data", field="body")  # no known extension: parquet bytes
    with pytest.raises(LmopsError, match="not UTF-8"):
        get(tmp_path, tmp_path / "c.data")  # auto reads an unknown extension as text
    get(tmp_path, tmp_path / "c.data", format="parquet", text_field="body")
    assert docs(tmp_path) == rows_as_docs()


def test_compressed_text(tmp_path):
    text = "alpha\n\nbeta\n\ngamma\n"
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "b.md.zst").write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    for name in ("a.txt.gz", "b.md.zst"):
        manifest = get(tmp_path, tmp_path / name)
        assert manifest["documents"] == 3 and (tmp_path / "raw/corpus.txt").read_text() == text


def test_directory_and_globs_read_sorted_files(tmp_path):
    corpus = tmp_path / "corpus"
    for rel in ("b.txt", "a.md", "sub/c.txt", "sub/deeper/d.txt", ".hidden.txt", ".git/config", "sub/e.py"):
        (corpus / rel).parent.mkdir(parents=True, exist_ok=True)
        (corpus / rel).write_text(f"text of {rel}\n")
    manifest = get(tmp_path, corpus)
    names = ["a.md", "b.txt", "sub/c.txt", "sub/deeper/d.txt", "sub/e.py"]
    assert manifest["files"] == [str(corpus / n) for n in names] and manifest["document_unit"] == "file"
    assert docs(tmp_path) == [f"text of {n}\n\n" for n in names]
    assert get(tmp_path, corpus / ".hidden.txt")["files"] == [str(corpus / ".hidden.txt")]  # named: read
    manifest = get(tmp_path, corpus / "**" / "*.txt")
    assert manifest["files"] == [str(corpus / n) for n in ("b.txt", "sub/c.txt", "sub/deeper/d.txt")]
    manifest = get(tmp_path, (corpus / "sub" / "*.txt").as_uri().replace("%2A", "*"))  # fsspec, as for s3://
    assert manifest["files"] == [(corpus / "sub/c.txt").as_uri()]


def test_directory_symlinks_are_followed_once_and_broken_ones_named(tmp_path):
    corpus, shared = tmp_path / "corpus", tmp_path / "shared"
    (corpus / "own").mkdir(parents=True)
    shared.mkdir()
    (corpus / "own/a.txt").write_text("own text\n")
    (shared / "b.txt").write_text("shared text\n")
    (corpus / "linked").symlink_to(shared)  # a directory assembled from links
    (corpus / "again").symlink_to(shared)  # the same directory twice: read once
    (shared / "loop").symlink_to(corpus)  # a loop ends
    manifest = get(tmp_path, corpus)
    assert manifest["files"] == [str(corpus / "again/b.txt"), str(corpus / "own/a.txt")]
    (corpus / "gone").symlink_to(tmp_path / "missing")
    with pytest.raises(LmopsError, match=r"broken symlink .*corpus/gone -> .*missing$"):
        get(tmp_path, corpus)


def test_relative_sources_are_listed_relative(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data/x.txt").write_text("x\n")
    (tmp_path / "data/y.txt").write_text("y\n")
    assert get(tmp_path, "data/*.txt")["files"] == ["data/x.txt", "data/y.txt"]


def test_file_url(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text("one\n\ntwo\n\nthree\n")
    for source in (str(src), src.as_uri()):
        manifest = get_data(DataConfig(source=source), tmp_path / "raw")
        assert manifest["documents"] == 3 and manifest["bytes"] == src.stat().st_size
        assert manifest["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
        assert (tmp_path / "raw" / "corpus.txt").read_bytes() == src.read_bytes()


def test_over_real_http(tmp_path):
    (tmp_path / "c.txt").write_text("alpha\n\nbeta\n\ngamma\n")
    write_table(tmp_path / "t.jsonl.gz")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert get_data(DataConfig(source=f"{base}/c.txt"), tmp_path / "raw")["documents"] == 3
        assert get_data(DataConfig(source=f"{base}/t.jsonl.gz"), tmp_path / "raw")["document_unit"] == "row"
        assert docs(tmp_path) == rows_as_docs()
        with pytest.raises(LmopsError, match="could not fetch.*404"):
            get_data(DataConfig(source=f"{base}/missing.txt"), tmp_path / "raw2")
    finally:
        server.shutdown()
    assert not (tmp_path / "raw2").exists()  # nothing half-written


def test_encoding_errors_replace(tmp_path):
    (tmp_path / "c.txt").write_bytes(b"caf\xe9 \xef\xbf\xbd\n\nna\xefve\n\nok\n")
    with pytest.raises(
        LmopsError, match=r"byte 0xe9 at offset 3 \(line 1, column 4\).*encoding_errors: replace"
    ):
        get(tmp_path, tmp_path / "c.txt")
    manifest = get(tmp_path, tmp_path / "c.txt", encoding_errors="replace")
    assert manifest["undecodable_sequences_replaced"] == 2  # the literal U+FFFD is not counted
    assert docs(tmp_path)[0] == "caf\ufffd \ufffd\n\n"


def jsonl(*lines):
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("e.txt", b"", "corpus is empty"),
        ("e.txt", b"  \n\n \n", "corpus is empty"),
        ("b.txt", b"good line\nbad \xff byte\n", r"not UTF-8: byte 0xff at offset 14 \(line 2, column 5\)"),
        (
            "j.jsonl",
            jsonl('{"text": "a"}', "", '{"text": "b",}'),
            r"j.jsonl: line 3 is not valid JSON: .*column 14",
        ),
        ("j.jsonl", jsonl('{"text": "a"}', "[1, 2]"), "line 2 is a JSON list, not an object"),
        (
            "j.jsonl",
            jsonl('{"text": "a"}', '{"body": "b", "id": 2}'),
            "line 2 has no field 'text' .*its fields: body, id",
        ),
        ("j.jsonl", jsonl('{"text": 5}'), "line 1: 'text' is a int, not a string"),
        ("c.csv", b"id,body\n1,x\n", "c.csv: the header has no field 'text' .*its fields: id, body"),
        ("c.csv", b'text\n"unterminated\n', "c.csv: not valid CSV"),
        (
            "c.tsv",
            b"id\ttext\n1\ta\n2\tb\tc\td\n",
            r"c.tsv: not valid TSV: .*Expected 2 fields in line 3, saw 4",
        ),
        ("c.tsv", b"id\ttext\n1\ta\tb\n", r"c.tsv: not valid TSV: Length of header .* does not match"),
        ("p.parquet", b"not parquet at all", "p.parquet: not valid Parquet"),
        ("c.txt.gz", b"not gzip", "c.txt.gz: not valid gzip"),
        ("c.txt.zst", b"not zstd", "c.txt.zst: not valid zstandard"),
    ],
)
def test_bad_input_is_one_clear_error_and_nothing_written(tmp_path, name, content, needle):
    (tmp_path / name).write_bytes(content.encode() if isinstance(content, str) else content)
    with pytest.raises(LmopsError, match=needle) as info:
        get(tmp_path, tmp_path / name)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "raw").exists()


def test_parquet_field_errors(tmp_path):
    pd.DataFrame({"id": [1, 2], "body": ["a", "b"]}).to_parquet(tmp_path / "p.parquet")
    with pytest.raises(LmopsError, match="the schema has no field 'text' .*its fields: id, body"):
        get(tmp_path, tmp_path / "p.parquet")
    with pytest.raises(LmopsError, match="column 'id' is int64, not a string"):
        get(tmp_path, tmp_path / "p.parquet", text_field="id")


def test_null_and_blank_rows_are_dropped_and_counted(tmp_path):
    (tmp_path / "j.jsonl").write_text(jsonl(*(json.dumps({"text": t}) for t in ["a", None, " ", "b", "c"])))
    manifest = get(tmp_path, tmp_path / "j.jsonl")
    assert manifest["documents"] == 3 and manifest["empty_documents_dropped"] == 2


def test_source_errors(tmp_path):
    with pytest.raises(LmopsError, match="no such file"):
        get(tmp_path, tmp_path / "absent.txt")
    with pytest.raises(LmopsError, match="unsupported source 'ftp://x'"):
        get(tmp_path, "ftp://x")
    with pytest.raises(LmopsError, match=r"glob '.*/\*\*/\*.txt' matched no files"):
        get(tmp_path, tmp_path / "**" / "*.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LmopsError, match="directory .*empty has no files"):
        get(tmp_path, tmp_path / "empty")
    with pytest.raises(LmopsError, match=r"gs:// needs an optional extra: pip install 'lmops\[gcs\]'"):
        get(tmp_path, "gs://bucket/corpus/*.jsonl")  # s3fs comes with dvc-s3; gcsfs is not installed
    (tmp_path / "c.txt").write_text("a\n\nb\n")
    with pytest.raises(LmopsError, match="sha256 mismatch"):
        get(tmp_path, tmp_path / "c.txt", sha256="0" * 64)
    assert not (tmp_path / "raw").exists()
