"""The split as it was before it streamed (whole corpus and document list in memory):
the reference the streaming split must equal on small corpora."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from lmops.pipeline.data import SPLITS, assign_splits
from lmops.pipeline.params import SplitConfig


def reference_split(raw_dir: Path, cfg: SplitConfig) -> tuple[dict[str, str], np.ndarray]:
    """The split texts and each document's first copy, computed in memory."""
    raw = (raw_dir / "corpus.txt").read_bytes()
    ends = np.frombuffer((raw_dir / "doc_offsets.bin").read_bytes(), dtype="<u8").astype(np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    docs = [raw[s:e].decode("utf-8") for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]
    seen: dict[bytes, int] = {}
    first = np.empty(len(docs), dtype=np.int64)
    for i, doc in enumerate(docs):
        key = hashlib.blake2b(" ".join(doc.split()).encode("utf-8"), digest_size=16).digest()
        first[i] = seen.setdefault(key, i)
    sizes = np.array([len(d.encode("utf-8")) for d in docs], dtype=np.int64)
    parts = assign_splits(sizes, cfg, first)
    return {name: "".join(docs[i] for i in parts[name]) for name in SPLITS}, first
