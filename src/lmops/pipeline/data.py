"""The corpus as documents (get_data stage) and the document-level train/val/test split.

get_data reads the source (lmops.pipeline.sources), cuts it into documents of one
`data.document_unit`, drops empty ones, caps the total at `data.max_bytes`, and
writes the documents back to back as data/raw/corpus.txt, with the end offset
of each in data/raw/doc_offsets.bin (little-endian uint64). Splitting by
document keeps every document whole inside one split, and exact duplicates
(after whitespace normalisation) go where their first copy goes, so nothing
of val or test leaks into training. split also writes artifacts/data_report.json.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from lmops import atomic
from lmops.errors import LmopsError
from lmops.pipeline.params import DataConfig, SplitConfig
from lmops.pipeline.paths import DATA_REPORT_FILE, PROCESSED_DIR, RAW_DIR
from lmops.pipeline.sources import STDLIB, SourceFile, list_files, read_file, stdlib_origin

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
_LINE_RE = re.compile(r"[^\n]*\n|[^\n]+$")


def _lines(text: str) -> list[str]:
    """Lines with their '\\n' (only '\\n' ends a line: form feeds and U+2028 are text)."""
    return _LINE_RE.findall(text)


def _paragraphs(text: str) -> Iterator[str]:
    """Runs of lines, each with the blank lines after it; a non-blank line after a blank one starts the next."""
    para, blank = [], False
    for line in _lines(text):
        is_blank = not line.strip()
        if para and blank and not is_blank:
            yield "".join(para)
            para = []
        para.append(line)
        blank = is_blank
    if para:
        yield "".join(para)


def _chunks(text: str, chunk_bytes: int) -> Iterator[str]:
    """Consecutive whole lines of at most `chunk_bytes` (a longer line is a chunk alone)."""
    chunk, size = [], 0
    for line in _lines(text):
        n = len(line.encode("utf-8"))
        if chunk and size + n > chunk_bytes:
            yield "".join(chunk)
            chunk, size = [], 0
        chunk.append(line)
        size += n
    if chunk:
        yield "".join(chunk)


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
    return "paragraph" if any(not line.strip() for line in _lines(file.texts[0])) else "chunk"


def file_documents(file: SourceFile, unit: str, chunk_bytes: int) -> Iterator[str]:
    """The documents of one file. Whole files and rows end with a blank line, so
    the model sees where one ends; pieces of a text keep its bytes, ending in '\\n'."""
    if unit in ("file", "row"):
        closed = [t.rstrip() + "\n\n" for t in file.texts]
        yield from closed if unit == "row" else ["".join(closed)]
        return
    for text in file.texts:
        if unit == "paragraph":
            pieces = _paragraphs(text)
        elif unit == "line":
            pieces = _lines(text)
        else:
            pieces = _chunks(text, chunk_bytes)
        for piece in pieces:
            yield piece if piece.endswith("\n") else piece + "\n"


def cap_documents(docs: Iterable[str], max_bytes: int | None) -> tuple[list[str], bool]:
    """Documents in order up to `max_bytes`, and whether the cap cut anything.

    The corpus ends at a document boundary, except that a document larger than
    the cap itself is cut at its last line boundary within the budget (at a
    character boundary when one line is larger still), so the cap never fails
    only because a document is large.
    """
    kept, total = [], 0
    for doc in docs:
        size = len(doc.encode("utf-8"))
        if max_bytes is None or total + size <= max_bytes:
            kept.append(doc)
            total += size
            continue
        if size > max_bytes:
            head = doc.encode("utf-8")[: max_bytes - total]
            piece = head[: head.rfind(b"\n") + 1 or len(head)].decode("utf-8", errors="ignore")
            if piece.strip():
                kept.append(piece)
        return kept, True
    return kept, False


def get_data(cfg: DataConfig, out_dir: Path = RAW_DIR) -> dict:
    """Read the source, cut it into documents, write corpus.txt, doc_offsets.bin, manifest.json."""
    files = list_files(cfg.source)
    origin = stdlib_origin() if cfg.source == STDLIB else cfg.source
    read, formats, units, counts = [], set(), set(), {"empty": 0, "replaced": 0}

    def documents() -> Iterator[str]:
        for name, load in files:
            file = read_file(name, load(), cfg)
            unit = resolve_unit(cfg, file, len(files))
            read.append(name)
            formats.add(file.format)
            units.add(unit)
            counts["replaced"] += file.replaced
            for doc in file_documents(file, unit, cfg.chunk_bytes):
                if doc.strip():
                    yield doc
                else:
                    counts["empty"] += 1

    docs, capped = cap_documents(documents(), cfg.max_bytes)
    if not docs:
        raise LmopsError(f"{origin}: corpus is empty (no document has any text)")
    encoded = [d.encode("utf-8") for d in docs]
    corpus = b"".join(encoded)
    digest = hashlib.sha256(corpus).hexdigest()
    if cfg.sha256 and digest != cfg.sha256:
        raise LmopsError(f"data.sha256 mismatch for {origin}: expected {cfg.sha256}, got {digest}")
    manifest = {
        "source": origin,
        "files": read,
        "files_matched": len(files),
        "format": "+".join(sorted(formats)),
        "document_unit": "+".join(sorted(units)),
        "documents": len(docs),
        "bytes": len(corpus),
        "sha256": digest,
        "empty_documents_dropped": counts["empty"],
        "undecodable_sequences_replaced": counts["replaced"],
        "max_bytes": cfg.max_bytes,
        "capped": capped,
    }
    ends = np.cumsum([len(e) for e in encoded], dtype=np.uint64)
    atomic.write_bytes(out_dir / "corpus.txt", corpus)
    atomic.write_bytes(out_dir / "doc_offsets.bin", ends.astype("<u8").tobytes())
    atomic.write_json(out_dir / "manifest.json", manifest)
    log.info(
        "corpus: %d %s documents from %d file(s), %d bytes, sha256 %s",
        len(docs),
        manifest["document_unit"],
        len(read),
        len(corpus),
        digest[:12],
    )
    return manifest


def read_documents(raw_dir: Path = RAW_DIR) -> list[str]:
    """The documents get_data wrote."""
    corpus_path, offsets_path = raw_dir / "corpus.txt", raw_dir / "doc_offsets.bin"
    if not (corpus_path.is_file() and offsets_path.is_file()):
        raise LmopsError(f"{corpus_path} or {offsets_path.name} not found: run `lmops get_data` first")
    raw = corpus_path.read_bytes()
    ends = np.frombuffer(offsets_path.read_bytes(), dtype="<u8").astype(np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    if not len(ends) or ends[-1] != len(raw) or np.any(ends <= starts):
        raise LmopsError(f"{offsets_path} does not match {corpus_path}: run `lmops get_data` again")
    try:
        return [raw[s:e].decode("utf-8") for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]
    except UnicodeDecodeError:
        raise LmopsError(f"{corpus_path} is damaged (not UTF-8): run `lmops get_data` again") from None


def first_copies(docs: list[str]) -> np.ndarray:
    """For each document, the index of its first exact copy (whitespace normalised): itself if none."""
    seen: dict[bytes, int] = {}
    first = np.empty(len(docs), dtype=np.int64)
    for i, doc in enumerate(docs):
        key = hashlib.blake2b(" ".join(doc.split()).encode("utf-8"), digest_size=16).digest()
        first[i] = seen.setdefault(key, i)
    return first


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
    """Write the three splits and the data report; stop before writing anything
    when a split would be empty or too small to train on."""
    docs = read_documents(raw_dir)
    sizes = np.array([len(d.encode("utf-8")) for d in docs], dtype=np.int64)
    # Byte-level BPE tokens cover at least one byte each, and training (and
    # evaluating) reads windows of max_seq_len + 1 tokens plus one more.
    min_bytes = max_seq_len + 2
    if sizes.sum() < 3 * min_bytes:
        raise LmopsError(
            f"corpus is too small to train on: {int(sizes.sum())} bytes; the minimum is 3 splits x "
            f"(model.max_seq_len + 2) = {3 * min_bytes} bytes"
        )
    first = first_copies(docs)
    stats = {}
    parts = assign_splits(sizes, cfg, first)
    for name, idx in parts.items():
        stats[name] = {"documents": len(idx), "bytes": int(sizes[idx].sum())}
        if stats[name]["bytes"] < min_bytes:
            raise LmopsError(
                f"split {name!r} has {stats[name]['bytes']} bytes, too small to train on: each split needs "
                f"at least model.max_seq_len + 2 = {min_bytes}; raise its fraction or add data"
            )
    for name, idx in parts.items():
        atomic.write_text(out_dir / f"{name}.txt", "".join(docs[i] for i in idx))
    report = data_report(raw_dir, sizes, first, cfg, stats)
    atomic.write_json(report_path, report)
    log.info(
        "split (%s): %s; %d duplicate(s) merged, %d of them dropped from a later split",
        cfg.method,
        stats,
        report["duplicates_merged"],
        report["duplicates_dropped"],
    )
    return report


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
        "split": {"method": cfg.method, **stats},
    }
