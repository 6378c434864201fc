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

    python benchmarks/quality.py [--max-steps N] [--threads N] [--out benchmarks/results/quality-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from lmops.runtime.model_config import LlamaShape

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
NANOGPT = {
    "nanoGPT baby GPT (CPU, ~3 min)": 1.88 / math.log(2),
    "nanoGPT shakespeare_char (A100)": 1.4697 / math.log(2),
}
TARGET_BITS_PER_BYTE, TARGET_TRAIN_SECONDS = 2.12, 600


def params(max_steps: int, threads: int = 0) -> dict:
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    base["data"].update(source=str(CORPUS), max_bytes=None, sha256=None)
    base["split"].update(method="tail", val_fraction=0.05, test_fraction=0.05)
    base["tokenizer"].update(vocab_size=1024)
    # The default shape, with residual dropout only (benchmarks/README.md, "Model quality").
    base["model"] = LlamaShape(dropout=0.2, attention_dropout=0.0).model_dump()
    base["train"].update(
        max_steps=max_steps,
        threads=threads,
        batch_size=16,
        learning_rate=2.0e-3,
        min_lr=2.0e-4,
        warmup_steps=30,
        lr_schedule="plateau",  # nothing depends on max_steps: --max-steps 2N is N, continued
        lr_plateau_patience=1,
        lr_plateau_factor=0.5,
        eval_interval=100,
        keep_best=True,
        checkpoint_interval=max_steps,
        eval_batches=8,
    )
    return base


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=1600)
    parser.add_argument("--threads", type=int, default=0, help="torch threads, 0 = torch's default")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/quality-cpu.json")
    args = parser.parse_args()
    if not CORPUS.is_file():
        print(f"skipped: {CORPUS} not found (the shared data folder is absent)")
        return 0

    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="lmops-quality-"))
    try:
        shutil.copy(REPO / "dvc.yaml", work)
        (work / "params.yaml").write_text(
            yaml.safe_dump(params(args.max_steps, args.threads), sort_keys=False)
        )
        lmops = str(Path(sys.executable).parent / "lmops")
        timings = {}
        for stage in ("get_data", "split", "tokenize", "train"):
            t0 = time.perf_counter()
            subprocess.run([lmops, stage], cwd=work, check=True)
            timings[stage] = round(time.perf_counter() - t0, 1)

        sys.path.insert(0, str(REPO / "src"))
        from lmops.pipeline.evaluate import score
        from lmops.runtime.model import Llama
        from lmops.runtime.quantize import quantize
        from lmops.runtime.tokenizer import chunks, load_tokenizer

        train_text = (work / "data/processed/train.txt").read_text()
        heldout = "".join((work / f"data/processed/{name}.txt").read_text() for name in ("val", "test"))
        corpus = CORPUS.read_text()
        assert corpus.startswith(train_text), "tail split: train must be the start of the corpus"
        split_at = {"ours": len(train_text), "nanoGPT": int(len(corpus) * 0.9)}
        report = json.loads((work / "artifacts/data_report.json").read_text())
        model_dir = work / "artifacts/model"
        tokenizer = load_tokenizer(model_dir)
        val = score(Llama.from_pretrained(model_dir), tokenizer, chunks(heldout))
        # The same weights as int8 weight-only (lmops.runtime.quantize): its quality cost.
        val_int8 = score(quantize(Llama.from_pretrained(model_dir), "int8"), tokenizer, chunks(heldout))
        state = json.loads((work / "artifacts/checkpoints/state.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)

    load_after = os.getloadavg()
    history = state["history"]
    rows = [("lmops (this run)", val["bits_per_byte"], timings["train"])]
    rows += [("lmops (this run), int8 weights", val_int8["bits_per_byte"], None)]
    rows += [(name, bpb, None) for name, bpb in NANOGPT.items()]
    print(f"\n{'model':36s} {'val bits/byte':>14s} {'train s':>8s}")
    for name, bpb, secs in rows:
        print(f"{name:36s} {bpb:14.3f} {'' if secs is None else f'{secs:8.0f}'}")
    met = val["bits_per_byte"] <= TARGET_BITS_PER_BYTE and timings["train"] <= TARGET_TRAIN_SECONDS
    print(
        f"\ntarget <= {TARGET_BITS_PER_BYTE} bits/byte within {TARGET_TRAIN_SECONDS} s of training: "
        f"{'MET' if met else 'NOT MET'}; ratio to nanoGPT A100: "
        f"{val['bits_per_byte'] / NANOGPT['nanoGPT shakespeare_char (A100)']:.3f}; exported step "
        f"{state['best_step']} of {state['step']}; load average {load_before[0]:.1f} -> {load_after[0]:.1f}"
    )
    int8_cost = val_int8["bits_per_byte"] / val["bits_per_byte"] - 1
    print(f"int8 weights cost {100 * int8_cost:+.3f}% bits/byte (target: within 1%)")
    result = {
        "corpus": str(CORPUS.name),
        "val": val,
        "val_int8": val_int8,
        "int8_relative_cost": int8_cost,
        "heldout_starts_at_byte": split_at,
        "heldout_duplicates_dropped": report["duplicates_dropped"],
        "stage_seconds": timings,
        "max_steps": args.max_steps,
        "params": {k: params(args.max_steps, args.threads)[k] for k in ("tokenizer", "model", "train")},
        "baselines_bits_per_byte": NANOGPT,
        "target_met": met,
        "exported_step": state["best_step"] if state["best_step"] is not None else state["step"],
        "stop_reason": state["stop_reason"],
        "val_loss_by_step": {r["step"]: r["val_loss"] for r in history if r.get("val_loss") is not None},
        "train_tokens_per_sec": round(sum(r["tokens_per_sec"] for r in history) / max(1, len(history))),
        "last_log": history[-1] if history else None,
        "load_average_1min": {"before": load_before[0], "after": load_after[0]},
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
