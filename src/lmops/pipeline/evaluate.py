"""Test-split evaluation: bits per byte over the whole split, unit by unit, and samples.

Bits per byte is the number comparable across tokenizers (and with character
models such as nanoGPT's): total negative log-likelihood in bits divided by the
UTF-8 bytes of the predicted tokens. The split is cut into units (blocks of whole lines,
`evaluate.unit_bytes`), each scored on its own with the model directory's own tokenizer,
so any two models (a champion trained on other data included) are measured on identical
text; all units when they fit `evaluate.max_units`, else a seeded sample with one unit
from each of max_units equal stretches of the split (every part of it, every document
in proportion). A unit never spans two slices of the split (promote.slice_by: split's
test_slices.json), so each slice's numbers are its units'. The per-unit results
(artifacts/eval/units.csv) are what promotion's paired comparison reads. Memory holds one
batch of units, whatever the split's size.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import math
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from lmops import atomic
from lmops.errors import LmopsError
from lmops.pipeline import tracking
from lmops.pipeline.params import EvaluateConfig, Params
from lmops.pipeline.paths import (
    METRICS_FILE,
    MODEL_DIR,
    PROCESSED_DIR,
    SAMPLES_FILE,
    TEST_SLICES_FILE,
    UNITS_FILE,
)
from lmops.pipeline.tokenize_stage import split_path
from lmops.runtime.engine import LLMEngine, SamplingParams
from lmops.runtime.model import Llama, resolve_device
from lmops.runtime.model_dir import require_meta
from lmops.runtime.tokenizer import load_tokenizer, token_byte_lengths

log = logging.getLogger(__name__)

UNITS_PER_BATCH = 64  # units encoded and held at once
UNIT_COLUMNS = ("unit", "offset", "tokens", "bytes", "nll_bits", "slice")

Run = tuple[int, str]  # a stretch of the split in one slice: (its end offset in bytes, the slice)


@dataclass(frozen=True)
class Unit:
    index: int  # among all of the split's units
    offset: int  # in bytes, into the split
    text: str
    slice: str = ""


def split_units(path: Path, unit_bytes: int, runs: Sequence[Run] = ()) -> Iterator[Unit]:
    """The split's text as blocks of whole lines of at least `unit_bytes` bytes, each cut
    short where a run of `runs` ends (the last may be shorter too); a line longer than 4 x
    unit_bytes characters is cut, so one unit's memory stays bounded whatever the file."""
    index, offset, lines, size = 0, 0, [], 0
    ends = iter(runs)
    run_end, name = next(ends, (None, ""))
    with open(path, encoding="utf-8", newline="") as fh:
        while line := fh.readline(4 * unit_bytes):
            lines.append(line)
            size += len(line.encode("utf-8"))
            at_run_end = offset + size == run_end
            if size >= unit_bytes or at_run_end:
                yield Unit(index, offset, "".join(lines), name)
                index, offset, lines, size = index + 1, offset + size, [], 0
            if at_run_end:
                run_end, name = next(ends, (None, name))
    if lines:
        yield Unit(index, offset, "".join(lines), name)


def select_units(total: int, max_units: int | None, seed: int) -> np.ndarray:
    """Indices of the units to score: all of them, or one seeded draw from each of
    `max_units` equal stretches of the split."""
    if max_units is None or total <= max_units:
        return np.arange(total)
    bounds = np.linspace(0, total, max_units + 1).astype(np.int64)
    return np.random.default_rng(seed).integers(bounds[:-1], bounds[1:])


@dataclass(frozen=True)
class UnitSelection:
    """Which units of which test split: two models scored on the same selection are
    compared unit by unit. `key` names it (the split's sha256 and the unit settings)."""

    path: Path
    split_sha256: str
    unit_bytes: int
    slice_by: str | None
    runs: tuple[Run, ...]
    indices: np.ndarray
    total: int

    @property
    def key(self) -> str:
        runs = hashlib.sha256(json.dumps([self.slice_by, self.runs]).encode()).hexdigest()
        text = f"{self.split_sha256}:{self.unit_bytes}:{runs}:{','.join(map(str, self.indices.tolist()))}"
        return hashlib.sha256(text.encode()).hexdigest()

    def units(self) -> Iterator[Unit]:
        wanted = set(self.indices.tolist())
        return (u for u in split_units(self.path, self.unit_bytes, self.runs) if u.index in wanted)


def read_test_slices(path: Path, split_size: int) -> tuple[str | None, tuple[Run, ...]]:
    """slice_by and the test split's runs, as split wrote them for this split."""
    slices_path = path.with_name(TEST_SLICES_FILE.name)
    try:
        found = json.loads(slices_path.read_text())
        runs = tuple((int(end), str(found["slices"][code])) for end, code in found["runs"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        raise LmopsError(f"{slices_path} is missing or damaged: run `lmops split` again") from None
    if not runs or runs[-1][0] != split_size:
        raise LmopsError(f"{slices_path} does not match {path}: run `lmops split` again")
    return found.get("slice_by"), runs


def unit_selection(cfg: EvaluateConfig, data_dir: Path = PROCESSED_DIR) -> UnitSelection:
    path, sha = read_test_split(data_dir)
    slice_by, runs = read_test_slices(path, path.stat().st_size)
    total = sum(1 for _ in split_units(path, cfg.unit_bytes, runs))
    if total == 0:
        raise LmopsError(f"{path} is empty: nothing to evaluate")
    indices = select_units(total, cfg.max_units, cfg.seed)
    return UnitSelection(path, sha, cfg.unit_bytes, slice_by, runs, indices, total)


@torch.no_grad()
def score_units(model: Llama, tokenizer, units: Iterable[Unit], batch_size: int) -> list[dict]:
    """Each unit's predicted tokens, their UTF-8 bytes and their NLL in bits: the unit
    alone, in windows of max_seq_len tokens (each window's first token predicted from
    the one before it), batched across units."""
    max_seq_len = model.config.max_seq_len
    byte_len = token_byte_lengths(tokenizer)
    device = next(model.parameters()).device
    rows = []
    it = iter(units)
    while group := [u for _, u in zip(range(UNITS_PER_BATCH), it, strict=False)]:
        encoded = tokenizer.encode_batch([u.text for u in group], add_special_tokens=False)
        windows = []  # (row in `group`, the window's ids: inputs and the targets after them)
        for row, enc in enumerate(encoded):
            ids = np.asarray(enc.ids, dtype=np.int64)
            windows += [(row, ids[s : s + max_seq_len + 1]) for s in range(0, len(ids) - 1, max_seq_len)]
        nll = np.zeros(len(group))
        tokens = np.zeros(len(group), dtype=np.int64)
        n_bytes = np.zeros(len(group), dtype=np.int64)
        for first in range(0, len(windows), batch_size):
            batch = windows[first : first + batch_size]
            width = max(len(w) for _, w in batch) - 1
            x = np.zeros((len(batch), width), dtype=np.int64)
            y = np.full((len(batch), width), -100, dtype=np.int64)
            for i, (_, w) in enumerate(batch):
                x[i, : len(w) - 1], y[i, : len(w) - 1] = w[:-1], w[1:]
            logits, _ = model(torch.from_numpy(x).to(device))
            targets = torch.from_numpy(y).to(device)
            loss = F.cross_entropy(
                logits.float().transpose(1, 2), targets, ignore_index=-100, reduction="none"
            )
            per_window = loss.sum(1).cpu().numpy() / math.log(2)
            for i, (row, w) in enumerate(batch):
                nll[row] += per_window[i]
                tokens[row] += len(w) - 1
                n_bytes[row] += int(byte_len[w[1:]].sum())
        rows += [
            {
                "unit": u.index,
                "offset": u.offset,
                "tokens": int(t),
                "bytes": int(b),
                "nll_bits": float(n),
                "slice": u.slice,
            }
            for u, t, b, n in zip(group, tokens, n_bytes, nll, strict=True)
        ]
    return rows


def summarize(rows: list[dict]) -> dict:
    """The split's numbers from its units': totals, not means of ratios."""
    bits = sum(r["nll_bits"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    if tokens == 0:
        raise LmopsError("the test units encode to no predicted tokens; nothing to evaluate")
    loss = bits * math.log(2) / tokens
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "bits_per_byte": bits / max(sum(r["bytes"] for r in rows), 1),
        "tokens": tokens,
        "bytes": sum(r["bytes"] for r in rows),
        "units": len(rows),
    }


def score(model: Llama, tokenizer, texts: Iterable[str], batch_size: int = 16) -> dict:
    """Loss, perplexity and bits/byte of `texts`, each scored as one unit (pass
    `lmops.runtime.tokenizer.chunks(text)` for one long text)."""
    if isinstance(texts, str):  # a str iterates as characters: each would be scored alone
        raise TypeError("score takes the text's pieces (lmops.runtime.tokenizer.chunks), not a str")
    units = (Unit(i, 0, t) for i, t in enumerate(texts))
    return summarize(score_units(model, tokenizer, units, batch_size))


def score_model_dir(
    model_dir: Path, selection: UnitSelection, cfg: EvaluateConfig, device: str
) -> list[dict]:
    """A model directory's units on `selection` (a champion's, for the paired comparison)."""
    model = Llama.from_pretrained(model_dir, device=resolve_device(device))
    return score_units(model, load_tokenizer(model_dir), selection.units(), cfg.batch_size)


def units_csv(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, UNIT_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def read_units(path: Path) -> list[dict]:
    """units.csv back as rows (the types score_units gives)."""
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            if tuple(reader.fieldnames or ()) != UNIT_COLUMNS:
                raise ValueError(f"columns {reader.fieldnames}, expected {list(UNIT_COLUMNS)}")
            return [
                {
                    "unit": int(r["unit"]),
                    "offset": int(r["offset"]),
                    "tokens": int(r["tokens"]),
                    "bytes": int(r["bytes"]),
                    "nll_bits": float(r["nll_bits"]),
                    "slice": r["slice"],
                }
                for r in reader
            ]
    except (OSError, ValueError) as exc:
        raise LmopsError(f"{path}: unreadable unit results ({exc}); run `lmops evaluate` again") from None


def units_artifact(key: str) -> str:
    """Where a run keeps its unit results for one selection (a run may be scored on several
    selections: the champion each time the test split changes)."""
    return f"eval/units-{key[:16]}.csv"


def log_units(run_id: str, path: Path, key: str) -> None:
    with tempfile.TemporaryDirectory(prefix="lmops-units-") as tmp:
        named = Path(tmp) / Path(units_artifact(key)).name
        shutil.copyfile(path, named)
        tracking.client().log_artifact(run_id, str(named), artifact_path="eval")


def fetch_units(run_id: str, key: str) -> list[dict] | None:
    """A run's unit results for the selection `key`, if it logged them."""
    listed = {a.path for a in tracking.client().list_artifacts(run_id, "eval")}
    if units_artifact(key) not in listed:
        return None
    with tempfile.TemporaryDirectory(prefix="lmops-units-") as tmp:
        local = tracking.client().download_artifacts(run_id, units_artifact(key), tmp)
        return read_units(Path(local))


def read_test_split(data_dir: Path = PROCESSED_DIR) -> tuple[Path, str]:
    """The test split's path and its sha256 (what makes two measurements comparable)."""
    path = split_path(data_dir, "test")
    return path, file_sha256(path)


def file_sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def sample_completions(
    engine: LLMEngine, prompts: list[str], sampling: SamplingParams
) -> list[tuple[str, str]]:
    """(prompt, completion) pairs from the inference engine."""
    outs = engine.generate(list(prompts), sampling)
    return [(prompt, out.text) for prompt, out in zip(prompts, outs, strict=True)]


def evaluate(params: Params, model_dir: Path = MODEL_DIR, data_dir: Path = PROCESSED_DIR) -> dict:
    cfg = params.evaluate
    meta = require_meta(model_dir)
    if meta.run_id:  # a tracking store that is down stops the stage before it writes anything
        tracking.configure(params.mlflow)
    selection = unit_selection(cfg, data_dir)
    # One load: the engine's model also scores the test split.
    # A handful of samples does not repay compiling the decode step (engine/compiled.py).
    engine = LLMEngine.from_pretrained(
        model_dir, device=params.train.device, max_num_seqs=len(cfg.prompts), compile=False
    )
    rows = score_units(engine.model, engine.tokenizer, selection.units(), cfg.batch_size)
    result = summarize(rows)
    metrics = {f"test_{k}": v for k, v in result.items()}
    metrics["test_units_total"] = selection.total
    metrics["val_loss"] = meta.metrics.get("val_loss")
    metrics["test_split_sha256"] = selection.split_sha256
    metrics["test_units_key"] = selection.key
    units_text = units_csv(rows)
    # What promote checks units.csv against: a kill between the two writes below leaves a pair that disagrees.
    metrics["test_units_sha256"] = hashlib.sha256(units_text.encode()).hexdigest()

    # The model's own sampling defaults, as `lmops generate`, the pyfunc and the API use them,
    # seeded so that the stage's output is reproducible.
    s = SamplingParams.from_model_dir(model_dir, max_tokens=cfg.max_new_tokens, seed=cfg.seed)
    samples = sample_completions(engine, cfg.prompts, s)
    lines = [
        f"# Samples (temperature {s.temperature}, top_k {s.top_k}, top_p {s.top_p}, "
        f"seed {s.seed}, run {meta.run_id})",
        "",
    ]
    # Python highlighting for the default corpus only: the samples read like the corpus.
    fence = "```python" if params.data.source == "python-stdlib" else "```text"
    for prompt, completion in samples:
        lines += [f"## `{prompt}`", "", fence, prompt + completion, "```", ""]
    atomic.write_text(SAMPLES_FILE, "\n".join(lines))
    atomic.write_text(UNITS_FILE, units_text)
    atomic.write_json(METRICS_FILE, metrics)

    if meta.run_id:
        # The test numbers only: val_loss is training's, and logging it again would add a
        # stray point at step 0 to its curve.
        numeric = {k: v for k, v in metrics.items() if k.startswith("test_") and isinstance(v, int | float)}
        with tracking.store_errors(tracking.tracking_uri(params.mlflow)):
            tracking.log_metrics(meta.run_id, numeric)
            tracking.client().log_artifact(meta.run_id, str(SAMPLES_FILE))
            tracking.client().log_artifact(meta.run_id, str(METRICS_FILE))
            log_units(meta.run_id, UNITS_FILE, selection.key)
    log.info(
        "test: loss %.4f, ppl %.2f, %.4f bits/byte over %d of %d units",
        result["loss"],
        result["perplexity"],
        result["bits_per_byte"],
        result["units"],
        selection.total,
    )
    return metrics
