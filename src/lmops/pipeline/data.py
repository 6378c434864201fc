"""The corpus as documents (get_data stage) and the document-level train/val/test split.

get_data reads the source (lmops.pipeline.sources), cuts it into documents of one
`data.document_unit`, drops empty ones, caps the total at `data.max_bytes`, and
writes the documents back to back as data/raw/corpus.txt, with the end offset
of each in data/raw/doc_offsets.bin (little-endian uint64). Splitting by
document keeps every document whole inside one split, and exact duplicates
(after whitespace normalisation) go where their first copy goes, so nothing
of val or test leaks into training. split also writes artifacts/data_report.json.

Both stages stream: memory holds a block of the input and, per document, its
offset and a 16-byte digest, never the corpus or a list of its documents.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import posixpath
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
from tqdm import tqdm

from lmops import atomic
from lmops.errors import LmopsError
from lmops.pipeline.model_card import data_card
from lmops.pipeline.params import DataConfig, SplitConfig
from lmops.pipeline.paths import (
    DATA_CARD_FILE,
    DATA_METRICS,
    DATA_METRICS_FILE,
    DATA_REPORT_FILE,
    PROCESSED_DIR,
    RAW_DIR,
    TEST_SLICES_FILE,
    THROUGHPUT_FILE,
)
from lmops.pipeline.sources import STDLIB, SourceFile, list_files, plain_name, read_file, stdlib_origin

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
# Each document's slice (a uint16 per document, beside doc_offsets.bin) and the slices'
# names: files of their own, not the manifest's, so that slicing differently retrains nothing.
DOC_SLICES, SLICES = "doc_slices.bin", "slices.json"
MAX_SLICES = 1000  # more are too small to compare, and a field with more is an id, not a slice
T = TypeVar("T")
READ_BYTES = 4 << 20  # the corpus is read, and outputs written, in pieces of about this size
WRITE_BYTES = 4 << 20
_LINE_RE = re.compile(r"[^\n]*\n|[^\n]+$")


def _lines(text: str) -> list[str]:
    """Lines with their '\\n' (only '\\n' ends a line: form feeds and U+2028 are text)."""
    return _LINE_RE.findall(text)


def _paragraphs(lines: Iterable[str]) -> Iterator[str]:
    """Runs of lines, each with the blank lines after it; a non-blank line after a blank one starts the next."""
    para, blank = [], False
    for line in lines:
        is_blank = not line.strip()
        if para and blank and not is_blank:
            yield "".join(para)
            para = []
        para.append(line)
        blank = is_blank
    if para:
        yield "".join(para)


def _chunks(lines: Iterable[str], chunk_bytes: int) -> Iterator[str]:
    """Consecutive whole lines of at most `chunk_bytes` (a longer line is a chunk alone)."""
    chunk, size = [], 0
    for line in lines:
        n = len(line.encode("utf-8"))
        if chunk and size + n > chunk_bytes:
            yield "".join(chunk)
            chunk, size = [], 0
        chunk.append(line)
        size += n
    if chunk:
        yield "".join(chunk)


def _block_lines(blocks: Iterable[str]) -> Iterator[str]:
    """The lines of a text read in blocks of whole lines."""
    for block in blocks:
        yield from _lines(block)


def progress(desc: str, total: int | None = None) -> tqdm:
    """A bar in bytes with MB/s for a long data stage (none when stderr is not a terminal)."""
    return tqdm(desc=desc, total=total, unit="B", unit_scale=True, disable=None, leave=False)


def resolve_unit(cfg: DataConfig, file: SourceFile, n_files: int) -> str:
    """`auto`: rows of a table, files of a multi-file source, else paragraphs when a
    single text file has blank lines, else chunks of whole lines."""
    if cfg.document_unit == "row" and not file.is_table:
        raise LmopsError(f"data.document_unit: row needs a table (jsonl, csv, parquet); {file.name} is text")
    if cfg.document_unit != "auto":
        return cfg.document_unit
    if file.is_table:
        return "row"
    if n_files > 1:
        return "file"
    first_text, _ = next(file.texts())
    return "paragraph" if any(not line.strip() for line in _block_lines(first_text)) else "chunk"


def file_documents(file: SourceFile, unit: str, chunk_bytes: int) -> Iterator[tuple[str, str | None]]:
    """The documents of one file, as it is read, each with its row's slice value (see
    SourceFile.texts). Whole files and rows end with a blank line, so the model sees where
    one ends; pieces of a text keep its bytes, ending in '\n'."""
    if unit == "file" and file.slice_field is not None:
        raise LmopsError(
            f"promote.slice_by: field:{file.slice_field} slices rows, but data.document_unit is file "
            f"(a document of {file.name} holds many rows): use document_unit row"
        )
    if unit in ("file", "row"):
        closed = (("".join(blocks).rstrip() + "\n\n", value) for blocks, value in file.texts())
        yield from closed if unit == "row" else [("".join(doc for doc, _ in closed), None)]
        return
    for blocks, value in file.texts():
        lines = _block_lines(blocks)
        if unit == "paragraph":
            pieces = _paragraphs(lines)
        elif unit == "line":
            pieces = lines
        else:
            pieces = _chunks(lines, chunk_bytes)
        for piece in pieces:
            yield (piece if piece.endswith("\n") else piece + "\n"), value


@dataclass
class Cap:
    """`data.max_bytes` over a stream of documents; `cut` says whether it cut anything.

    The corpus ends at a document boundary, except that a document larger than
    the cap itself is cut at its last line boundary within the budget (at a
    character boundary when one line is larger still), so the cap never fails
    only because a document is large. Reading stops at the cap.
    """

    max_bytes: int | None
    cut: bool = False

    def apply(self, docs: Iterable[tuple[str, T]]) -> Iterator[tuple[bytes, T]]:
        """The documents kept, UTF-8 encoded, each with what came with it (its slice)."""
        total = 0
        for doc, tag in docs:
            data = doc.encode("utf-8")
            if self.max_bytes is None or total + len(data) <= self.max_bytes:
                total += len(data)
                yield data, tag
                continue
            if len(data) > self.max_bytes:
                head = data[: self.max_bytes - total]
                piece = head[: head.rfind(b"\n") + 1 or len(head)].decode("utf-8", errors="ignore")
                if piece.strip():
                    yield piece.encode("utf-8"), tag
            self.cut = True
            return


class Slices:
    """Each document's slice of the corpus (promote.slice_by) as a small number, the slices'
    names in the order first seen: what promotion compares the test split by. With no
    slice_by, every document is in the one slice ""."""

    def __init__(self, slice_by: str | None):
        self.by = slice_by
        self.field = slice_by.removeprefix("field:") if slice_by and slice_by.startswith("field:") else None
        self.codes: dict[str, int] = {}

    def code(self, name: str, value: str | None) -> int:
        """The slice of a document of file `name` (`value`: its row's field)."""
        if self.by is None:
            label = ""
        elif self.by == "path":
            label = name
        elif self.by == "directory":
            label = posixpath.dirname(name) or "."
        elif self.by == "extension":
            label = posixpath.splitext(plain_name(name))[1] or "(none)"
        else:
            label = str(value)
        code = self.codes.setdefault(label, len(self.codes))
        if len(self.codes) > MAX_SLICES:
            raise LmopsError(
                f"promote.slice_by: {self.by} cuts the corpus into more than {MAX_SLICES} slices "
                f"({label!r} of {name} is one more): slice by a coarser key, or null for none"
            )
        return code

    def as_dict(self) -> dict:
        return {"slice_by": self.by, "slices": list(self.codes)}


def get_data(cfg: DataConfig, out_dir: Path = RAW_DIR, slice_by: str | None = None) -> dict:
    """Read the source, cut it into documents and write them as they come: corpus.txt,
    doc_offsets.bin, manifest.json, and each document's slice (`slice_by`, see `Slices`):
    doc_slices.bin and slices.json. Nothing is held but one file's current block (or one
    document, or one CSV/Parquet file); a failure leaves no output, not even `out_dir`."""
    files = list_files(cfg.source)
    origin = stdlib_origin() if cfg.source == STDLIB else cfg.source
    read, formats, units, counts = [], set(), set(), {"empty": 0, "replaced": 0}
    slices = Slices(slice_by)

    def documents() -> Iterator[tuple[str, int]]:
        for name, load in files:
            file = read_file(name, load, cfg, slices.field)
            unit = resolve_unit(cfg, file, len(files))
            read.append(name)
            formats.add(file.format)
            units.add(unit)
            for doc, value in file_documents(file, unit, cfg.chunk_bytes):
                if doc.strip():
                    yield doc, slices.code(name, value)
                else:
                    counts["empty"] += 1
            counts["replaced"] += file.replaced

    started = time.perf_counter()
    cap = Cap(cfg.max_bytes)
    docs = cap.apply(documents())
    first = next(docs, None)  # the source opens (or fails) before anything is written
    if first is None:
        raise LmopsError(f"{origin}: corpus is empty (no document has any text)")
    for name in ("corpus.txt", "doc_offsets.bin", "manifest.json", DOC_SLICES, SLICES):
        atomic.remove_stale(out_dir / name)
    created = not out_dir.exists()
    digest, n_docs, n_bytes = hashlib.sha256(), 0, 0
    try:
        with (
            atomic.writer(out_dir / "corpus.txt") as corpus,
            atomic.writer(out_dir / "doc_offsets.bin") as offsets,
            atomic.writer(out_dir / DOC_SLICES) as doc_slices,
            progress("get_data") as bar,
        ):
            pending, ends, codes, written = [], [], [], 0

            def flush() -> None:
                data = b"".join(pending)
                digest.update(data)
                corpus.write(data)
                offsets.write(np.array(ends, dtype="<u8").tobytes())
                doc_slices.write(np.array(codes, dtype="<u2").tobytes())
                bar.update(len(data))
                for buffer in (pending, ends, codes):
                    buffer.clear()

            for doc, code in itertools.chain([first], docs):
                n_docs, n_bytes = n_docs + 1, n_bytes + len(doc)
                pending.append(doc)
                ends.append(n_bytes)
                codes.append(code)
                if n_bytes - written >= WRITE_BYTES:
                    flush()
                    written = n_bytes
            flush()
            if cfg.sha256 and digest.hexdigest() != cfg.sha256:
                raise LmopsError(
                    f"data.sha256 mismatch for {origin}: expected {cfg.sha256}, got {digest.hexdigest()}"
                )
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                out_dir.rmdir()  # only if empty: what the failed run created
        raise
    seconds = time.perf_counter() - started
    manifest = {
        "source": origin,
        "files": read,
        "files_matched": len(files),
        "format": "+".join(sorted(formats)),
        "document_unit": "+".join(sorted(units)),
        "documents": n_docs,
        "bytes": n_bytes,
        "sha256": digest.hexdigest(),
        "empty_documents_dropped": counts["empty"],
        "undecodable_sequences_replaced": counts["replaced"],
        "max_bytes": cfg.max_bytes,
        "capped": cap.cut,
    }
    atomic.write_json(out_dir / SLICES, slices.as_dict())
    atomic.write_json(out_dir / "manifest.json", manifest)
    log.info(
        "corpus: %d %s documents from %d file(s), %d bytes, sha256 %s, %.1f MB/s",
        n_docs,
        manifest["document_unit"],
        len(read),
        n_bytes,
        manifest["sha256"][:12],
        record_throughput("get_data", seconds, n_bytes),
    )
    return manifest


def record_throughput(stage: str, seconds: float, n_bytes: int) -> float:
    """Note a stage's seconds and MB/s in artifacts/throughput.json (see paths.THROUGHPUT_FILE); its MB/s."""
    mb_per_s = round(n_bytes / 1e6 / max(seconds, 1e-9), 2)
    done = json.loads(THROUGHPUT_FILE.read_text()) if THROUGHPUT_FILE.is_file() else {}
    done[stage] = {"seconds": round(seconds, 2), "mb_per_s": mb_per_s}
    atomic.write_json(THROUGHPUT_FILE, done)
    return mb_per_s


def doc_offsets(raw_dir: Path = RAW_DIR) -> np.ndarray:
    """The end offset of every document get_data wrote (8 bytes a document), checked against the corpus."""
    corpus_path, offsets_path = raw_dir / "corpus.txt", raw_dir / "doc_offsets.bin"
    if not (corpus_path.is_file() and offsets_path.is_file()):
        raise LmopsError(f"{corpus_path} or {offsets_path.name} not found: run `lmops get_data` first")
    ends = np.fromfile(offsets_path, dtype="<u8").astype(np.int64)
    if not len(ends) or ends[-1] != corpus_path.stat().st_size or np.any(np.diff(ends, prepend=0) <= 0):
        raise LmopsError(f"{offsets_path} does not match {corpus_path}: run `lmops get_data` again")
    return ends


def raw_documents(raw_dir: Path, ends: np.ndarray) -> Iterator[bytes]:
    """The documents' bytes in order, the corpus read in blocks."""
    with open(raw_dir / "corpus.txt", "rb") as fh:
        buf, base, start = b"", 0, 0  # buf holds the corpus from byte `base` on
        for first in range(0, len(ends), 1 << 16):
            for end in ends[first : first + (1 << 16)].tolist():
                if end > base + len(buf):
                    buf = buf[start - base :] + fh.read(max(READ_BYTES, end - start))
                    base = start
                yield buf[start - base : end - base]
                start = end


def read_documents(raw_dir: Path = RAW_DIR) -> Iterator[str]:
    """The documents get_data wrote, one at a time."""
    corpus_path = raw_dir / "corpus.txt"
    for doc in raw_documents(raw_dir, doc_offsets(raw_dir)):
        try:
            yield doc.decode("utf-8")
        except UnicodeDecodeError:
            raise LmopsError(f"{corpus_path} is damaged (not UTF-8): run `lmops get_data` again") from None


def doc_slices(raw_dir: Path, n_docs: int) -> dict:
    """get_data's slices: slice_by, the slices' names and each document's slice ("codes")."""
    path = raw_dir / DOC_SLICES
    try:
        slices = json.loads((raw_dir / SLICES).read_text())
        codes = np.fromfile(path, dtype="<u2")
    except (OSError, ValueError):
        raise LmopsError(
            f"{raw_dir / SLICES} or {path.name} is missing or damaged: run `lmops get_data` again"
        ) from None
    if len(codes) != n_docs or (n_docs and int(codes.max()) >= len(slices.get("slices", []))):
        raise LmopsError(f"{path} does not match {raw_dir / 'doc_offsets.bin'}: run `lmops get_data` again")
    return {**slices, "codes": codes}


class SliceRuns:
    """A split's text as runs of documents of one slice: (end offset in bytes, slice) each,
    what evaluate cuts its units at. As many runs as the slice changes, at most one a document."""

    def __init__(self) -> None:
        self.ends: list[int] = []
        self.codes: list[int] = []
        self.size = 0

    def add(self, n_bytes: int, code: int) -> None:
        self.size += n_bytes
        if self.codes and self.codes[-1] == code:
            self.ends[-1] = self.size
        else:
            self.ends.append(self.size)
            self.codes.append(code)

    def as_dict(self, slice_by: str | None, names: list[str]) -> dict:
        return {
            "slice_by": slice_by,
            "slices": names,
            "runs": [list(r) for r in zip(self.ends, self.codes, strict=True)],
        }


def doc_key(doc: str) -> bytes:
    """A document's fixed-size digest after whitespace normalisation: equal for exact copies."""
    return hashlib.blake2b(" ".join(doc.split()).encode("utf-8"), digest_size=16).digest()


def first_copies(keys: np.ndarray) -> np.ndarray:
    """For each document (a row of 16-byte `keys`), the index of its first exact copy: itself if none."""
    _, index, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    return index[inverse.reshape(-1)]


def assign_splits(sizes: list[int] | np.ndarray, cfg: SplitConfig, first: np.ndarray | None = None) -> dict:
    """Document -> split assignment (indices in source order); copies go where their first copy goes.

    `random` deals the distinct documents out by a seeded permutation, each with its
    copies. `tail` cuts the corpus in source order at the document boundaries
    nearest to the byte fractions: train, then val, then test (val + test = the
    last val_fraction + test_fraction of it); a copy that falls in a later split
    than its first copy is dropped, as the text is already in that earlier split.
    """
    n = len(sizes)
    first = np.arange(n) if first is None else first
    distinct = np.flatnonzero(first == np.arange(n))
    if len(distinct) < 3:
        raise LmopsError(
            f"corpus has {len(distinct)} distinct document(s); need at least 3 (one per split): "
            "add data or choose a smaller data.document_unit (line, or chunk with a smaller data.chunk_bytes)"
        )
    where = np.empty(n, dtype=np.int64)  # 0 train, 1 val, 2 test
    if cfg.method == "tail":
        ends = np.concatenate([[0], np.cumsum(sizes, dtype=np.float64)])

        def boundary(fraction: float) -> int:
            return int(np.abs(ends - fraction * ends[-1]).argmin())

        a = min(max(boundary(1 - cfg.val_fraction - cfg.test_fraction), 1), n - 2)
        b = min(max(boundary(1 - cfg.test_fraction), a + 1), n - 1)
        where[:a], where[a:b], where[b:] = 0, 1, 2
        kept = where == where[first]
    else:
        order = np.random.default_rng(cfg.seed).permutation(distinct)
        n_val = max(1, round(len(distinct) * cfg.val_fraction))
        n_test = max(1, round(len(distinct) * cfg.test_fraction))
        if n_val + n_test >= len(distinct):
            raise LmopsError(
                f"split 'train' would be empty: {len(distinct)} distinct documents are too few for "
                f"split.val_fraction={cfg.val_fraction} and split.test_fraction={cfg.test_fraction}"
            )
        where[order[:n_val]], where[order[n_val : n_val + n_test]], where[order[n_val + n_test :]] = 1, 2, 0
        where = where[first]
        kept = np.ones(n, dtype=bool)
    parts = {}
    for code, name in enumerate(SPLITS):
        parts[name] = np.flatnonzero((where == code) & kept)
        if not len(parts[name]):
            raise LmopsError(
                f"split {name!r} would be empty: its {int((where == code).sum())} document(s) all copy "
                f"documents of an earlier split; raise split.{name}_fraction or add data"
            )
    return parts


def split(
    cfg: SplitConfig,
    max_seq_len: int,
    raw_dir: Path = RAW_DIR,
    out_dir: Path = PROCESSED_DIR,
    report_path: Path = DATA_REPORT_FILE,
) -> dict:
    """Write the three splits, the data report, its headline numbers (the DVC metrics) and
    its data card (beside the report); stop before writing anything
    when a split would be empty or too small to train on.

    Two reads of the corpus, one document at a time: the first takes each document's
    16-byte digest (dedup), the sizes come from the offsets; the split of every
    document follows from those alone; the second read writes each to its split.
    """
    started = time.perf_counter()
    ends = doc_offsets(raw_dir)
    slices = doc_slices(raw_dir, len(ends))
    sizes = np.diff(ends, prepend=0)
    # Byte-level BPE tokens cover at least one byte each, and training (and
    # evaluating) reads windows of max_seq_len + 1 tokens plus one more.
    min_bytes = max_seq_len + 2
    if sizes.sum() < 3 * min_bytes:
        raise LmopsError(
            f"corpus is too small to train on: {int(sizes.sum())} bytes; the minimum is 3 splits x "
            f"(model.max_seq_len + 2) = {3 * min_bytes} bytes"
        )
    keys = bytearray()
    with progress("split", total=2 * int(sizes.sum())) as bar:
        for doc in read_documents(raw_dir):
            keys += doc_key(doc)
            bar.update(len(doc))  # characters: close enough for a rate
        first = first_copies(np.frombuffer(bytes(keys), dtype=np.uint8).reshape(-1, 16))
        del keys
        stats = {}
        parts = assign_splits(sizes, cfg, first)
        for name, idx in parts.items():
            stats[name] = {"documents": len(idx), "bytes": int(sizes[idx].sum())}
            if stats[name]["bytes"] < min_bytes:
                raise LmopsError(
                    f"split {name!r} has {stats[name]['bytes']} bytes, too small to train on: each split "
                    f"needs at least model.max_seq_len + 2 = {min_bytes}; raise its fraction or add data"
                )
        warn_if_lopsided(stats, sizes, cfg)
        where = np.full(len(sizes), -1, dtype=np.int8)  # -1: a copy dropped from a later split
        for code, idx in enumerate(parts.values()):
            where[idx] = code
        del parts
        for name in SPLITS:
            atomic.remove_stale(out_dir / f"{name}.txt")
        atomic.remove_stale(out_dir / TEST_SLICES_FILE.name)
        test_runs = SliceRuns()
        with contextlib.ExitStack() as stack:
            outs = [stack.enter_context(atomic.writer(out_dir / f"{name}.txt")) for name in SPLITS]
            pending: list[list[bytes]] = [[], [], []]
            size = 0
            rows = zip(where.tolist(), slices["codes"].tolist(), raw_documents(raw_dir, ends), strict=True)
            for code, slice_code, doc in rows:
                if code >= 0:
                    pending[code].append(doc)
                if code == SPLITS.index("test"):
                    test_runs.add(len(doc), slice_code)
                size += len(doc)
                if size >= WRITE_BYTES:
                    for out, docs in zip(outs, pending, strict=True):
                        out.write(b"".join(docs))
                        docs.clear()
                    bar.update(size)
                    size = 0
            for out, docs in zip(outs, pending, strict=True):
                out.write(b"".join(docs))
    atomic.write_json(
        out_dir / TEST_SLICES_FILE.name, test_runs.as_dict(slices["slice_by"], slices["slices"])
    )
    seconds = time.perf_counter() - started
    report = data_report(raw_dir, sizes, first, cfg, stats)
    atomic.write_json(report_path, report)
    atomic.write_json(report_path.with_name(DATA_METRICS_FILE.name), {k: report[k] for k in DATA_METRICS})
    atomic.write_text(report_path.with_name(DATA_CARD_FILE.name), data_card(report))
    log.info(
        "split (%s): %s; %d duplicate(s) merged, %d of them dropped from a later split; %.1f MB/s",
        cfg.method,
        stats,
        report["duplicates_merged"],
        report["duplicates_dropped"],
        record_throughput("split", seconds, report["bytes"]),
    )
    return report


def warn_if_lopsided(stats: dict, sizes: np.ndarray, cfg: SplitConfig) -> None:
    """Splits are drawn by document, so a few huge documents (one 2 MB JSONL record
    among small ones) can put most of the bytes in one split: say so, with the fix,
    when a split holds under half or over twice its share of the bytes."""
    total = int(sizes.sum())
    wanted = {
        "train": 1 - cfg.val_fraction - cfg.test_fraction,
        "val": cfg.val_fraction,
        "test": cfg.test_fraction,
    }
    shares = {name: stats[name]["bytes"] / total for name in wanted}
    if all(abs(shares[n] - f) <= 0.05 or f / 2 <= shares[n] <= 2 * f for n, f in wanted.items()):
        return
    log.warning(
        "the splits hold %s of the corpus bytes, not %s: splits are drawn by document and the "
        "largest document is %.1f%% of the corpus; cut documents smaller with "
        "data.document_unit: chunk (and data.chunk_bytes)",
        " / ".join(f"{name} {100 * share:.1f}%" for name, share in shares.items()),
        " / ".join(f"{100 * f:.0f}%" for f in wanted.values()),
        100 * int(sizes.max()) / total,
    )


def data_report(raw_dir: Path, sizes: np.ndarray, first: np.ndarray, cfg: SplitConfig, stats: dict) -> dict:
    """What the data checks saw: the corpus, its documents, and the splits."""
    manifest_path = raw_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    q = np.percentile(sizes, [0, 10, 50, 90, 99, 100])
    return {
        "source": manifest.get("source"),
        "sha256": manifest.get("sha256"),
        "document_unit": manifest.get("document_unit"),
        "files": len(manifest.get("files", [])),
        "documents": len(sizes),
        "bytes": int(sizes.sum()),
        "empty_documents_dropped": manifest.get("empty_documents_dropped", 0),
        "undecodable_sequences_replaced": manifest.get("undecodable_sequences_replaced", 0),
        "capped_at_max_bytes": manifest.get("capped", False),
        "duplicates_merged": int((first != np.arange(len(first))).sum()),
        "duplicates_dropped": len(sizes) - sum(s["documents"] for s in stats.values()),
        "document_bytes": dict(
            zip(("min", "p10", "p50", "p90", "p99", "max"), (int(v) for v in q), strict=True)
        )
        | {"mean": round(float(sizes.mean()), 1)},
        "split": {"method": cfg.method, "seed": cfg.seed, **stats},
    }
