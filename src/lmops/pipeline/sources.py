"""Where a corpus comes from and how its files read as text (get_data's input side).

A source is the python standard library, or a file, a directory or a glob, as a
local path or an fsspec URL (file://, s3://, az://, gs://; https:// is one file).
Files are taken in sorted order and read as a stream; each reads as a `SourceFile`:
one text, or one text per row of a table (JSONL, CSV/TSV, Parquet: the
`data.text_field`). `.gz` and `.zst` files are decompressed as they are read; the
format comes from the extension under the compression one, unless `data.format` names it.
A table's rows can also carry a second field (promote.slice_by's field:NAME), the value
promotion slices the test split by.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import itertools
import json
import logging
import os
import posixpath
import sys
import sysconfig
import tempfile
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlparse

from lmops.errors import LmopsError
from lmops.pipeline.params import DataConfig

log = logging.getLogger(__name__)

STDLIB = "python-stdlib"
FILE_HEADER = "# <|file|> "
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_FSSPEC_SCHEMES = ("file", "s3", "az", "abfs", "gs", "gcs")
_EXTRAS = {"s3": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure"}
_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "csv", ".tab": "csv"}
_FORMATS |= {".parquet": "parquet", ".pq": "parquet"}

Loader = Callable[[], BinaryIO]  # opens one file of the source for reading


BLOCK_BYTES = 1 << 20  # files are read in blocks of about this size, cut at a line end
TABLE_ROWS = 10_000  # a CSV is parsed, a Parquet file read, this many rows at a time


@dataclass
class SourceFile:
    """One file of the source, read only as it is consumed, so no file is held whole (a
    CSV is parsed `TABLE_ROWS` rows at a time, a Parquet file a batch of a row group at a
    time). `texts()` yields each text (the file's, or one per row of a table) as an
    iterator of blocks of whole lines; every call reads the file again (`auto` looks at
    a text once before cutting it)."""

    name: str
    format: str  # text | jsonl | csv | parquet
    load: Loader
    cfg: DataConfig
    slice_field: str | None = None  # a table's field read beside the text (promote.slice_by)
    replaced: int = 0  # undecodable byte sequences replaced by U+FFFD (encoding_errors: replace)

    @property
    def is_table(self) -> bool:
        return self.format != "text"

    def texts(self) -> Iterator[tuple[Iterator[str], str | None]]:
        """Each text's blocks, with its row's `slice_field` value (None for a text file or
        when no field is asked for)."""
        self.replaced = 0
        fields = Fields(self.cfg.text_field, self.slice_field)
        if self.slice_field is not None and not self.is_table:
            raise LmopsError(
                f"promote.slice_by: field:{self.slice_field} needs a table (jsonl, csv, parquet); "
                f"{self.name} is text: slice it by path, directory or extension"
            )
        if self.format == "parquet":
            rows = _parquet_rows(self.name, self.load(), fields)
        else:
            raw = _raw_blocks(self.name, self.load())
            if self.format == "jsonl":
                rows = _jsonl_rows(self.name, self._text_blocks(raw), fields)
            elif self.format == "csv":
                sep = "\t" if plain_name(self.name).endswith((".tsv", ".tab")) else ","
                rows = _csv_rows(self.name, _BlocksAsFile(self._text_blocks(raw)), fields, sep)
            else:
                yield self._text_blocks(raw), None
                return
        for text, value in rows:
            yield iter([text]), value

    def _text_blocks(self, raw: Iterator[bytes]) -> Iterator[str]:
        """Decoded blocks of whole lines ('\n' never sits inside a UTF-8 sequence, so a cut
        there is a character boundary); an undecodable byte names its place in the file."""
        offset, line, carry = 0, 1, b""
        for data in raw:
            data = carry + data
            cut = data.rfind(b"\n") + 1
            block, carry = data[:cut], data[cut:]
            if block:
                yield self._decode(block, offset, line)
                offset, line = offset + len(block), line + block.count(b"\n")
        if carry:
            yield self._decode(carry, offset, line)

    def _decode(self, block: bytes, offset: int, line: int) -> str:
        text, replaced = decode_utf8(block, self.name, self.cfg.encoding_errors, offset, line)
        self.replaced += replaced
        return text


def stdlib_files() -> list[tuple[str, Loader]]:
    """The running interpreter's standard library `.py` sources, sorted, no tests.

    Each file's text starts with a `FILE_HEADER` line naming it, so a model sees
    where one module ends and the next begins.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        header = f"{FILE_HEADER}{rel.as_posix()}\n".encode()
        files.append((f"{STDLIB}/{rel.as_posix()}", lambda p=path, h=header: io.BytesIO(h + p.read_bytes())))
    return files


def stdlib_origin() -> str:
    return f"{STDLIB} ({sys.version.split()[0]})"


def list_files(source: str) -> list[tuple[str, Loader]]:
    """(name, loader) of every file of `source`, in sorted order."""
    if source == STDLIB:
        return stdlib_files()
    scheme = urlparse(source).scheme
    if scheme in ("http", "https"):
        return [(source, lambda: _http_get(source))]
    if scheme and scheme not in _FSSPEC_SCHEMES:
        raise LmopsError(
            f"data.source: unsupported source {source!r}; use python-stdlib, a path, "
            "file://, https://, s3://, az:// or gs://"
        )
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(source if scheme else os.path.expanduser(source))
        if any(c in path for c in "*?["):
            root = path[: min(path.find(c) for c in "*?[" if c in path)].rpartition("/")[0]
            paths = [p for p in fs.glob(path) if fs.isfile(p)]
            what = f"glob {source!r} matched no files"
        elif fs.isdir(path):
            found = _local_files(path) if fs.protocol[0] == "file" else fs.find(path)
            root, paths, what = path, found, f"directory {source} has no files"
        elif fs.isfile(path):
            root, paths, what = None, [path], ""  # named explicitly: read even if a dot file
        else:
            raise LmopsError(f"data.source: no such file: {source}")
    except ImportError as exc:
        raise LmopsError(
            f"data.source: {scheme}:// needs an optional extra: "
            f"pip install 'lmops[{_EXTRAS.get(scheme, 'azure')}]' ({exc})"
        ) from None
    except (OSError, ValueError) as exc:
        raise LmopsError(f"data.source: could not read {source}: {exc}") from None
    if root is not None:
        paths = sorted(p for p in paths if not _hidden(posixpath.relpath(p, root or "/")))
    if not paths:
        raise LmopsError(f"data.source: {what}")

    def name(p: str) -> str:
        if scheme:
            return fs.unstrip_protocol(p)
        return p if os.path.isabs(source) else os.path.relpath(p)

    def load(p: str) -> BinaryIO:
        try:
            return fs.open(p, "rb")
        except (OSError, ValueError) as exc:
            raise LmopsError(f"data.source: could not read {name(p)}: {exc}") from None

    return [(name(p), lambda p=p: load(p)) for p in paths]


def _local_files(root: str) -> list[str]:
    """Every file under a local directory, following symlinks to directories (a corpus
    folder is often assembled from links), each directory once, so a loop ends and two
    links to one directory read it once (by its first name in sorted order); a broken
    link is an error that names it, not a file that fails to open later."""
    files, seen = [], set()
    for top, dirs, names in os.walk(root, followlinks=True):
        dirs.sort()
        real = os.path.realpath(top)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        for name in sorted(names):
            path = os.path.join(top, name)
            if not os.path.exists(path):
                raise LmopsError(f"data.source: broken symlink {path} -> {os.readlink(path)}")
            files.append(path)
    return files


def _hidden(rel: str) -> bool:
    """Dot files and dot directories (.git, .DS_Store) are never corpus."""
    return any(part.startswith(".") and part not in (".", "..") for part in rel.split("/"))


def _http_get(url: str) -> BinaryIO:
    import requests

    try:
        resp = requests.get(url, timeout=60, stream=True)
        resp.raise_for_status()
    except requests.RequestException as exc:
        raise LmopsError(f"data.source: could not fetch {url}: {exc}") from None
    resp.raw.decode_content = True  # a Content-Encoding is undone, as `resp.content` did
    return resp.raw


def decode_utf8(
    raw: bytes, origin: str, errors: str = "strict", offset: int = 0, line: int = 1
) -> tuple[str, int]:
    """The text and how many undecodable sequences became U+FFFD (only with errors='replace');
    `raw` starts at byte `offset` of the file, at the start of line `line`."""
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError as exc:
        if errors == "replace":
            text = raw.decode("utf-8", errors="replace")
            return text, text.count("\ufffd") - raw.count("\ufffd".encode())
        line += raw.count(b"\n", 0, exc.start)
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise LmopsError(
            f"{origin}: not UTF-8: byte 0x{raw[exc.start]:02x} at offset {offset + exc.start} "
            f"(line {line}, column {col}) {exc.reason}; data.encoding_errors: replace reads it anyway"
        ) from None


def _lower_path(name: str) -> str:
    return urlparse(name).path.lower() if "://" in name else name.lower()


def plain_name(name: str) -> str:
    """The file's name, lower case, without its compression extension."""
    return _lower_path(name).removesuffix(".gz").removesuffix(".zst")


def _compressed(name: str) -> bool:
    return _lower_path(name).endswith((".gz", ".zst"))


def _raw_blocks(name: str, stream: BinaryIO) -> Iterator[bytes]:
    """The file's plain bytes in blocks, decompressed as they are read."""
    path = _lower_path(name)
    reader, kind, errors = stream, "", ()
    if path.endswith(".gz"):
        reader, kind, errors = gzip.GzipFile(fileobj=stream), "gzip", (OSError, EOFError, zlib.error)
    elif path.endswith(".zst"):
        import zstandard

        reader, kind, errors = (
            zstandard.ZstdDecompressor().stream_reader(stream),
            "zstandard",
            zstandard.ZstdError,
        )
    with stream:
        while True:
            try:
                data = reader.read(BLOCK_BYTES)
            except errors as exc:
                raise LmopsError(f"{name}: not valid {kind}: {exc}") from None
            if not data:
                return
            yield data


def read_file(name: str, load: Loader, cfg: DataConfig, slice_field: str | None = None) -> SourceFile:
    plain = plain_name(name)
    fmt = cfg.format if cfg.format != "auto" else _FORMATS.get(posixpath.splitext(plain)[1], "text")
    return SourceFile(name, fmt, load, cfg, slice_field)


@dataclass(frozen=True)
class Fields:
    """The fields a table's row is read for: its text and, optionally, its slice."""

    text: str
    slice: str | None

    def check(self, name: str, where: str, existing: list[str]) -> None:
        for field, key in ((self.text, "data.text_field"), (self.slice, "promote.slice_by")):
            if field is not None and field not in existing:
                raise LmopsError(
                    f"{name}: {where} has no field {field!r} ({key}); "
                    f"its fields: {', '.join(map(str, existing)) or 'none'}"
                )

    def slice_value(self, value: object, where: str) -> str | None:
        """A row's slice as text: a string as it is, a number, a boolean or null as JSON writes it."""
        if self.slice is None:
            return None
        if isinstance(value, str):
            return value
        if value is None or isinstance(value, int | float | bool):
            return json.dumps(value)
        raise LmopsError(f"{where}: {self.slice!r} is a {type(value).__name__}, not a value to slice by")


def _jsonl_rows(name: str, blocks: Iterator[str], fields: Fields) -> Iterator[tuple[str, str | None]]:
    """One (text, slice) per line, as the lines are read. Parsed line by line (not pandas)
    to name the line that fails."""
    lines = (line for block in blocks for line in block.removesuffix("\n").split("\n"))
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LmopsError(
                f"{name}: line {number} is not valid JSON: {exc.msg} (column {exc.colno})"
            ) from None
        if not isinstance(obj, dict):
            raise LmopsError(f"{name}: line {number} is a JSON {type(obj).__name__}, not an object")
        where = f"{name}: line {number}"
        fields.check(name, f"line {number}", list(obj))
        text = _text_value(obj[fields.text], f"{where}: {fields.text!r}")
        yield text, fields.slice_value(obj.get(fields.slice), where)


def _text_value(value: object, where: str) -> str:
    if value is None:
        return ""  # an empty document: dropped and counted
    if not isinstance(value, str):
        raise LmopsError(f"{where} is a {type(value).__name__}, not a string")
    return value


class _BlocksAsFile(io.TextIOBase):
    """Decoded blocks as a text file to read from, so pandas parses a CSV as it arrives."""

    def __init__(self, blocks: Iterator[str]):
        self._blocks, self._buffer = blocks, ""

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> str:
        while size is None or size < 0 or len(self._buffer) < size:
            block = next(self._blocks, None)
            if block is None:
                break
            self._buffer += block
        cut = len(self._buffer) if size is None or size < 0 else size
        out, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return out


def _csv_rows(name: str, text: io.TextIOBase, fields: Fields, sep: str) -> Iterator[tuple[str, str | None]]:
    """The (text, slice) of each row of a CSV (or TSV), `TABLE_ROWS` rows at a time."""
    import pandas as pd

    kind = "TSV" if sep == "\t" else "CSV"
    try:
        with warnings.catch_warnings():  # a row longer than the header: an error, not lost fields
            warnings.simplefilter("error", pd.errors.ParserWarning)
            frames = pd.read_csv(
                text, sep=sep, dtype=str, keep_default_na=False, index_col=False, chunksize=TABLE_ROWS
            )
            for frame in frames:
                fields.check(name, "the header", list(frame.columns))
                texts = (v if isinstance(v, str) else "" for v in frame[fields.text].tolist())
                slices = frame[fields.slice].tolist() if fields.slice else itertools.repeat(None)
                yield from zip(texts, slices, strict=False)
    except pd.errors.EmptyDataError:
        return
    except (pd.errors.ParserError, pd.errors.ParserWarning, ValueError) as exc:
        raise LmopsError(f"{name}: not valid {kind}: {_one_line(exc)}") from None


def _parquet_rows(name: str, stream: BinaryIO, fields: Fields) -> Iterator[tuple[str, str | None]]:
    """The (text, slice) of each row of a Parquet file, a batch of `TABLE_ROWS` at a time. Arrow reads a file by
    seeking to its footer: a compressed file or a stream that cannot seek (https://) is
    first decompressed into a temporary file, not memory."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with contextlib.ExitStack() as stack:
        source = stack.enter_context(stream)
        if _compressed(name) or not stream.seekable():
            source = stack.enter_context(tempfile.TemporaryFile())
            for block in _raw_blocks(name, stream):
                source.write(block)
            source.seek(0)
        try:
            table = pq.ParquetFile(source, pre_buffer=False)  # True reads every row group at once
            fields.check(name, "the schema", table.schema_arrow.names)
            kind = table.schema_arrow.field(fields.text).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise LmopsError(f"{name}: column {fields.text!r} is {kind}, not a string")
            columns = [fields.text] + ([fields.slice] if fields.slice else [])
            where = f"{name}: column {fields.slice!r}"
            for batch in table.iter_batches(batch_size=TABLE_ROWS, columns=columns):
                texts = [v or "" for v in batch.column(0).to_pylist()]
                values = batch.column(1).to_pylist() if fields.slice else [None] * len(texts)
                yield from zip(texts, (fields.slice_value(v, where) for v in values), strict=True)
        except (pa.ArrowException, OSError) as exc:
            raise LmopsError(f"{name}: not valid Parquet: {_one_line(exc)}") from None


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())
