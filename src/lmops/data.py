"""Corpus sources (get_data stage) and the document-level train/val/test split.

A corpus is a UTF-8 text made of documents. The python-stdlib source marks each
file with a header line (`FILE_HEADER`); any other text is split into documents
at blank lines (paragraphs). Splitting by document keeps every document whole
inside one split, so nothing of the test set leaks into training.
"""

from __future__ import annotations

import hashlib
import logging
import re
import sys
import sysconfig
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from lmops import atomic
from lmops.config import DataConfig, SplitConfig
from lmops.errors import LmopsError
from lmops.paths import PROCESSED_DIR, RAW_DIR

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
FILE_HEADER = "# <|file|> "
_HEADER_RE = re.compile(rf"^(?={re.escape(FILE_HEADER)})", re.MULTILINE)
_PARAGRAPH_RE = re.compile(r"(?<=\n\n)(?=[^\n])")
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_corpus() -> bytes:
    """The running interpreter's standard library `.py` sources, sorted, no tests."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        body = path.read_bytes()
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            log.warning("skipping %s: not UTF-8", rel)
            continue
        if not body.strip():
            continue
        parts.append(f"{FILE_HEADER}{rel.as_posix()}\n".encode() + body.rstrip(b"\n") + b"\n\n")
    return b"".join(parts)


def _fetch(source: str) -> bytes:
    """Bytes of a local path, file://, https:// or an fsspec cloud URL."""
    scheme = urlparse(source).scheme
    if scheme in ("", "file"):
        path = Path(source[len("file://") :] if scheme == "file" else source).expanduser()
        if not path.is_file():
            raise LmopsError(f"data.source: no such file: {path}")
        return path.read_bytes()
    if scheme in ("http", "https"):
        import requests

        try:
            resp = requests.get(source, timeout=60)
            resp.raise_for_status()
        except requests.RequestException as exc:
            raise LmopsError(f"data.source: could not fetch {source}: {exc}") from None
        return resp.content
    if scheme in ("s3", "az", "abfs", "gs", "gcs"):
        import fsspec

        try:
            with fsspec.open(source, "rb") as fh:
                return fh.read()
        except ImportError as exc:
            extra = {"s3": "s3", "gs": "gcs", "gcs": "gcs"}.get(scheme, "azure")
            raise LmopsError(
                f"data.source: {scheme}:// needs an optional extra: pip install 'lmops[{extra}]' ({exc})"
            ) from None
        except (OSError, ValueError) as exc:
            raise LmopsError(f"data.source: could not read {source}: {exc}") from None
    raise LmopsError(
        f"data.source: unsupported source {source!r}; use python-stdlib, a path, "
        "file://, https://, s3://, az:// or gs://"
    )


def decode_utf8(raw: bytes, origin: str) -> str:
    if not raw.strip():
        raise LmopsError(f"{origin}: corpus is empty")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise LmopsError(
            f"{origin}: not UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start} "
            f"(line {line}, column {col}) {exc.reason}"
        ) from None


def documents(text: str) -> list[str]:
    """Split a corpus into documents; joining them with '' gives the corpus back."""
    pattern = _HEADER_RE if text.startswith(FILE_HEADER) else _PARAGRAPH_RE
    return [d for d in pattern.split(text) if d]


def cap_documents(docs: list[str], max_bytes: int | None) -> list[str]:
    """Whole documents, in order, skipping any that would overflow `max_bytes`."""
    if max_bytes is None:
        return docs
    kept, total = [], 0
    for doc in docs:
        size = len(doc.encode("utf-8"))
        if total + size <= max_bytes:
            kept.append(doc)
            total += size
    if not kept:
        raise LmopsError(f"data.max_bytes={max_bytes} is smaller than every document of the corpus")
    return kept


def get_data(cfg: DataConfig, out_dir: Path = RAW_DIR) -> dict:
    """Fetch the corpus, validate it, write corpus.txt and manifest.json atomically."""
    if cfg.source == "python-stdlib":
        raw, origin = stdlib_corpus(), f"python-stdlib ({sys.version.split()[0]})"
    else:
        raw, origin = _fetch(cfg.source), cfg.source
    text = decode_utf8(raw, origin)
    docs = cap_documents(documents(text), cfg.max_bytes)
    corpus = "".join(docs).encode("utf-8")
    digest = hashlib.sha256(corpus).hexdigest()
    if cfg.sha256 and digest != cfg.sha256:
        raise LmopsError(f"data.sha256 mismatch for {origin}: expected {cfg.sha256}, got {digest}")
    manifest = {"source": origin, "bytes": len(corpus), "sha256": digest, "documents": len(docs)}
    atomic.write_text(out_dir / "corpus.txt", corpus.decode("utf-8"))
    atomic.write_json(out_dir / "manifest.json", manifest)
    log.info("corpus: %s documents, %s bytes, sha256 %s", len(docs), len(corpus), digest[:12])
    return manifest


def assign_splits(sizes: list[int] | np.ndarray, cfg: SplitConfig) -> dict[str, np.ndarray]:
    """Document -> split assignment (indices in source order); every split gets a document.

    `random` deals documents out by a seeded permutation. `tail` cuts the corpus in
    source order at the document boundaries nearest to the byte fractions: train,
    then val, then test (val + test = the last val_fraction + test_fraction of it).
    """
    n_docs = len(sizes)
    if n_docs < 3:
        raise LmopsError(
            f"corpus has {n_docs} document(s); need at least 3 (one per split) to train: "
            "add data or choose a smaller data.document_unit"
        )
    if cfg.method == "tail":
        ends = np.concatenate([[0], np.cumsum(sizes, dtype=np.float64)])
        total = ends[-1]

        def boundary(fraction: float) -> int:
            return int(np.abs(ends - fraction * total).argmin())

        a = min(max(boundary(1 - cfg.val_fraction - cfg.test_fraction), 1), n_docs - 2)
        b = min(max(boundary(1 - cfg.test_fraction), a + 1), n_docs - 1)
        idx = np.arange(n_docs)
        return {"train": idx[:a], "val": idx[a:b], "test": idx[b:]}
    order = np.random.default_rng(cfg.seed).permutation(n_docs)
    n_val = max(1, round(n_docs * cfg.val_fraction))
    n_test = max(1, round(n_docs * cfg.test_fraction))
    if n_val + n_test >= n_docs:
        raise LmopsError(f"corpus has {n_docs} documents: too few for these split fractions")
    return {
        "train": np.sort(order[n_val + n_test :]),
        "val": np.sort(order[:n_val]),
        "test": np.sort(order[n_val : n_val + n_test]),
    }


def split(cfg: SplitConfig, raw_dir: Path = RAW_DIR, out_dir: Path = PROCESSED_DIR) -> dict:
    corpus_path = raw_dir / "corpus.txt"
    if not corpus_path.is_file():
        raise LmopsError(f"{corpus_path} not found: run `lmops get_data` first")
    docs = documents(decode_utf8(corpus_path.read_bytes(), str(corpus_path)))
    sizes = [len(d.encode("utf-8")) for d in docs]
    stats = {}
    for name, idx in assign_splits(sizes, cfg).items():
        text = "".join(docs[i] for i in idx)
        atomic.write_text(out_dir / f"{name}.txt", text)
        stats[name] = {"documents": len(idx), "bytes": len(text.encode("utf-8"))}
    log.info("split (%s): %s", cfg.method, stats)
    return stats
