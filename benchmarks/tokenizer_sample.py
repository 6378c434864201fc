"""How much of the train split the BPE must learn from: `tokenizer.train_bytes`, by measurement.

The tokenize stage trains byte-level BPE on a seeded sample of at most `train_bytes` of the
train split (`TrainingSample`), then encodes everything. This trains the same tokenizer
(`train_tokenizer`, the repo's vocab size) on samples of growing size from one real corpus
and measures, for each, the training time and peak RSS (each in its own process) and the
compression it reaches on held-out text (bytes per token: higher is better, and what bits per
byte and the model's context depend on). The corpus is real text that is on every machine:
the `.py` sources under the running interpreter's prefix (the standard library and every
installed package), each file a document, every 20th file held out.

    python benchmarks/tokenizer_sample.py [--corpus-mb 300] [--budgets-mb 4 16 64 256]
                                          [--work DIR]

Prints a table and writes benchmarks/results/tokenizer-sample-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import run_measured  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "tokenizer-sample-cpu.json"
HELD_OUT_EVERY = 20
VAL_BYTES = 8_000_000

TRAIN_ONE = """
import json, sys, time
from pathlib import Path
from lmops.pipeline.params import TokenizerConfig
from lmops.pipeline.tokenize_stage import TrainingSample, train_tokenizer
from lmops.runtime.tokenizer import chunks
budget, work = int(sys.argv[1]), Path(sys.argv[2])
cfg = TokenizerConfig()
sample = TrainingSample(work / "train.txt", budget, cfg.seed)
started = time.perf_counter()
tok = train_tokenizer(sample, cfg.vocab_size, cfg.min_frequency)
seconds = time.perf_counter() - started
text = (work / "val.txt").read_text(encoding="utf-8")
ids = sum(len(e.ids) for e in tok.encode_batch_fast(list(chunks(text)), add_special_tokens=False))
print(json.dumps({"train_seconds": round(seconds, 2), "sampled_bytes": sample.bytes,
                  "val_bytes_per_token": round(len(text.encode()) / ids, 4)}))
"""


def build_corpus(work: Path, corpus_bytes: int) -> dict:
    """train.txt and val.txt from the interpreter's .py sources, in sorted path order."""
    train, val = work / "train.txt", work / "val.txt"
    if train.is_file() and train.stat().st_size + val.stat().st_size >= corpus_bytes:
        return {"train_bytes": train.stat().st_size, "val_bytes": val.stat().st_size}
    work.mkdir(parents=True, exist_ok=True)
    written = {"train": 0, "val": 0}
    with open(train, "wb") as t, open(val, "wb") as v:
        for i, path in enumerate(sorted(Path(sys.prefix).rglob("*.py"))):
            data = path.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            held_out = i % HELD_OUT_EVERY == 0 and written["val"] < VAL_BYTES
            (v if held_out else t).write(data + b"\n\n")
            written["val" if held_out else "train"] += len(data) + 2
            if sum(written.values()) >= corpus_bytes:
                break
    return {"train_bytes": written["train"], "val_bytes": written["val"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus-mb", type=int, default=300)
    parser.add_argument("--budgets-mb", type=int, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--work", type=Path, default=Path("/tmp/lmops-tokenizer-sample"))
    args = parser.parse_args()
    corpus = build_corpus(args.work, args.corpus_mb * 1_000_000)
    runs = {}
    for mb in args.budgets_mb:
        measured, out = run_measured(
            [sys.executable, "-c", TRAIN_ONE, str(mb * 1_000_000), str(args.work)], args.work
        )
        runs[f"{mb}MB"] = measured | json.loads(out)
    best = max(r["val_bytes_per_token"] for r in runs.values())
    print(f"corpus: {corpus['train_bytes'] / 1e6:.0f} MB train, {corpus['val_bytes'] / 1e6:.0f} MB held out")
    print(
        f"{'train_bytes':>12} {'sampled MB':>10} {'train s':>8} {'peak RSS MB':>12} {'val bytes/token':>16} {'of best':>8}"
    )
    for name, r in runs.items():
        r["of_best"] = round(r["val_bytes_per_token"] / best, 4)
        print(
            f"{name:>12} {r['sampled_bytes'] / 1e6:>10.1f} {r['train_seconds']:>8} {r['peak_rss_mb']:>12} "
            f"{r['val_bytes_per_token']:>16} {r['of_best']:>8}"
        )
    result = {
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "load_average": os.getloadavg()},
        "corpus": corpus | {"source": f"*.py under {sys.prefix}, every {HELD_OUT_EVERY}th file held out"},
        "runs": runs,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
