"""Model quality on tiny Shakespeare, next to nanoGPT's published numbers.

Runs the real pipeline stages (get_data, split, tokenize, train) in a scratch
project on ../shared/data/tinyshakespeare.txt, then measures validation bits
per byte over the held-out text. nanoGPT's character-level baselines on the
same corpus: CPU "baby GPT" 1.88 nats/char = 2.71 bits/byte (about 3 minutes on
a laptop), GPU run 1.47 nats/char = 2.12 bits/byte (one A100). The corpus is
ASCII, so one character is one byte.

The split is nanoGPT's: `split.method: tail` trains on the file's first 90% and
holds out the last 10% (our val split, the first 5% of it, then test), cut at
the paragraph boundary nearest nanoGPT's character cut (3 bytes away), so the
held-out plays are never seen in training. We measure on val + test, which
together are that last 10%, less any held-out paragraph that repeats one of
training word for word, which the split drops as leakage (here one: a bare
"PETRUCHIO:", 12 bytes).

    python benchmarks/quality.py [--max-steps N] [--out benchmarks/results/quality-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
NANOGPT = {
    "nanoGPT baby GPT (CPU, ~3 min)": 1.88 / math.log(2),
    "nanoGPT shakespeare_char (A100)": 1.4697 / math.log(2),
}
TARGET_BITS_PER_BYTE, TARGET_TRAIN_SECONDS = 2.40, 600


def params(max_steps: int) -> dict:
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    base["data"].update(source=str(CORPUS), max_bytes=None, sha256=None)
    base["split"].update(method="tail", val_fraction=0.05, test_fraction=0.05)
    base["tokenizer"].update(vocab_size=1024)
    base["model"].update(
        n_layer=4, n_head=6, n_kv_heads=2, n_embd=192, intermediate_size=512, max_seq_len=256
    )
    base["train"].update(
        max_steps=max_steps,
        batch_size=16,
        learning_rate=2.0e-3,
        min_lr=2.0e-4,
        warmup_steps=30,
        eval_interval=max(1, max_steps // 5),
        checkpoint_interval=max_steps,
        eval_batches=8,
    )
    return base


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=500)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/quality-cpu.json")
    args = parser.parse_args()
    if not CORPUS.is_file():
        print(f"skipped: {CORPUS} not found (the shared data folder is absent)")
        return 0

    work = Path(tempfile.mkdtemp(prefix="lmops-quality-"))
    try:
        shutil.copy(REPO / "dvc.yaml", work)
        (work / "params.yaml").write_text(yaml.safe_dump(params(args.max_steps), sort_keys=False))
        lmops = str(Path(sys.executable).parent / "lmops")
        timings = {}
        for stage in ("get_data", "split", "tokenize", "train"):
            t0 = time.perf_counter()
            subprocess.run([lmops, stage], cwd=work, check=True)
            timings[stage] = round(time.perf_counter() - t0, 1)

        sys.path.insert(0, str(REPO / "src"))
        from lmops.config import EvaluateConfig
        from lmops.evaluate import evaluate_dir

        train_text = (work / "data/processed/train.txt").read_text()
        heldout = "".join((work / f"data/processed/{name}.txt").read_text() for name in ("val", "test"))
        corpus = CORPUS.read_text()
        assert corpus.startswith(train_text), "tail split: train must be the start of the corpus"
        split_at = {"ours": len(train_text), "nanoGPT": int(len(corpus) * 0.9)}
        report = json.loads((work / "artifacts/data_report.json").read_text())
        val = evaluate_dir(
            work / "artifacts/model", heldout, EvaluateConfig(max_batches=10_000, batch_size=16)
        )
        history = json.loads((work / "artifacts/checkpoints/state.json").read_text())["history"]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows = [("lmops (this run)", val["bits_per_byte"], timings["train"])]
    rows += [(name, bpb, None) for name, bpb in NANOGPT.items()]
    print(f"\n{'model':36s} {'val bits/byte':>14s} {'train s':>8s}")
    for name, bpb, secs in rows:
        print(f"{name:36s} {bpb:14.3f} {'' if secs is None else f'{secs:8.0f}'}")
    met = val["bits_per_byte"] <= TARGET_BITS_PER_BYTE and timings["train"] <= TARGET_TRAIN_SECONDS
    print(
        f"\ntarget <= {TARGET_BITS_PER_BYTE} bits/byte within {TARGET_TRAIN_SECONDS} s of training: "
        f"{'MET' if met else 'NOT MET'}; ratio to nanoGPT baby GPT: "
        f"{val['bits_per_byte'] / NANOGPT['nanoGPT baby GPT (CPU, ~3 min)']:.3f}"
    )
    result = {
        "corpus": str(CORPUS.name),
        "val": val,
        "heldout_starts_at_byte": split_at,
        "heldout_duplicates_dropped": report["duplicates_dropped"],
        "stage_seconds": timings,
        "max_steps": args.max_steps,
        "params": params(args.max_steps)["model"],
        "baselines_bits_per_byte": NANOGPT,
        "target_met": met,
        "last_log": history[-1] if history else None,
        "machine": {
            "cpus": torch.get_num_threads(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
