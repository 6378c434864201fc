"""The training recipe (issue 32): today's default, AdamW with warmup + cosine, against Muon
(`train.optimizer: muon`) with cosine and with wsd, at equal steps, in the same run.

    python benchmarks/recipe.py [--steps 300] [--max-bytes 8000000] [--corpus stdlib|shakespeare]
        [--muon-lr LR] [--other-muon-lrs LR ...] [--eval-interval 25] [--out benchmarks/results/recipe-cpu.json]

One project in a temporary directory: params.yaml's defaults (the default corpus capped at
--max-bytes, or ../shared/data/tinyshakespeare.txt with nanoGPT's tail split), get_data,
split and tokenize once, then per recipe `lmops train` from scratch with max_steps --steps
(and train.eval_interval --eval-interval, so the curves say when a loss was reached).
Each exported model (the best validation step's) is scored on the whole val and test splits
by lmops.pipeline.evaluate.score (bits per byte, as `lmops evaluate` scores). Beside them:
training seconds, tokens/s (median of the logged rows: Muon's orthogonalisation is its
cost) and the first evaluated step whose validation loss is at or below the baseline's
best, with the training seconds up to it (from the logged tokens/s), against the baseline's
seconds to its best: "time to the same loss". Prints a table; writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml
from gate import cpu, lmops

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
BASELINE = "adamw + cosine"


def recipes(muon_lr: float, other_lrs: list[float]) -> dict[str, dict]:
    """Each recipe's train overrides of params.yaml, whatever its defaults (the first is the baseline)."""
    muon = {"optimizer": "muon", "muon_lr": muon_lr, "lr_schedule": "cosine"}
    return {
        BASELINE: {"optimizer": "adamw", "lr_schedule": "cosine"},
        "muon + cosine": muon,
        "muon + wsd": {**muon, "lr_schedule": "wsd"},
        **{f"muon + wsd, lr {lr:g}": {**muon, "muon_lr": lr, "lr_schedule": "wsd"} for lr in other_lrs},
    }


def base_params(args: argparse.Namespace) -> dict:
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    if args.corpus == "shakespeare":
        base["data"].update(source=str(SHAKESPEARE), max_bytes=None, sha256=None)
        base["split"].update(method="tail")
    else:
        base["data"]["max_bytes"] = args.max_bytes
    base["mlflow"]["tracking_uri"] = "sqlite:///mlflow.db"
    base["train"].update(
        max_steps=args.steps, checkpoint_interval=args.steps, eval_interval=args.eval_interval
    )
    return base


def train_and_score(work: Path, base: dict, overrides: dict) -> dict:
    from lmops.pipeline.evaluate import score
    from lmops.runtime.model import Llama
    from lmops.runtime.tokenizer import chunks, load_tokenizer

    params = json.loads(json.dumps(base))
    params["train"].update(overrides)
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.rmtree(work / "artifacts/checkpoints", ignore_errors=True)  # a fresh run, not a resume
    shutil.rmtree(work / "artifacts/checkpoints-before-cooldown", ignore_errors=True)
    t0 = time.perf_counter()
    lmops(work, "train")
    seconds = time.perf_counter() - t0
    model_dir = work / "artifacts/model"
    model, tokenizer = Llama.from_pretrained(model_dir), load_tokenizer(model_dir)
    bits = {
        split: score(model, tokenizer, chunks((work / f"data/processed/{split}.txt").read_text()))[
            "bits_per_byte"
        ]
        for split in ("val", "test")
    }
    history = json.loads((work / "artifacts/checkpoints/state.json").read_text())["history"]
    return {
        "train_s": round(seconds, 1),
        "history": history,
        **{f"{k}_bits_per_byte": v for k, v in bits.items()},
    }


def seconds_to(history: list[dict], target: float) -> tuple[int | None, float | None]:
    """The first evaluated step with validation loss <= target, and the training seconds to it
    (each logged row's tokens over its tokens/s: steps only, no start-up or compile)."""
    elapsed, tokens = 0.0, 0
    for row in history:
        elapsed += (row["tokens"] - tokens) / row["tokens_per_sec"]
        tokens = row["tokens"]
        if row.get("val_loss") is not None and row["val_loss"] <= target:
            return row["step"], round(elapsed, 1)
    return None, None


def optimizer_step_ms(base: dict, vocab_size: int, rounds: int = 5, steps: int = 10) -> dict[str, float]:
    """One optimizer step (AdamW alone, Muon + AdamW) on the default model with random
    gradients, in this process, alternating rounds: the median ms, robust to other jobs
    coming and going (the training runs are sequential, so their tokens/s are not)."""
    import torch

    from lmops.pipeline.optim import make_optimizer
    from lmops.pipeline.params import TrainConfig
    from lmops.runtime.model import Llama
    from lmops.runtime.model_config import LlamaConfig

    model = Llama(LlamaConfig(vocab_size=vocab_size, **base["model"]))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opts = {
        o: make_optimizer(model, TrainConfig(optimizer=o), torch.device("cpu")) for o in ("adamw", "muon")
    }
    times: dict[str, list[float]] = {o: [] for o in opts}
    for _ in range(rounds):
        for name, opt in opts.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                opt.step()
            times[name].append((time.perf_counter() - t0) * 1000 / steps)
    return {name: round(statistics.median(t), 2) for name, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--max-bytes", type=int, default=8_000_000, help="of the stdlib corpus")
    parser.add_argument("--corpus", choices=("stdlib", "shakespeare"), default="stdlib")
    parser.add_argument("--muon-lr", type=float, default=None, help="default: params.yaml's train.muon_lr")
    parser.add_argument("--other-muon-lrs", type=float, nargs="*", default=[], help="muon + wsd at these too")
    parser.add_argument(
        "--eval-interval", type=int, default=25, help="train.eval_interval: the curve's resolution"
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/recipe-cpu.json")
    args = parser.parse_args()
    base = base_params(args)
    muon_lr = args.muon_lr if args.muon_lr is not None else base["train"]["muon_lr"]
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="lmops-recipe-bench-"))
    try:
        shutil.copy(REPO / "dvc.yaml", work)
        (work / "params.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
        for stage in ("get_data", "split", "tokenize"):
            lmops(work, stage)
        runs = {
            name: train_and_score(work, base, o) for name, o in recipes(muon_lr, args.other_muon_lrs).items()
        }
        vocab_size = json.loads((work / "artifacts/tokenizer/stats.json").read_text())["vocab_size"]
        step_ms = optimizer_step_ms(base, vocab_size)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    reference = runs[BASELINE]
    target = min(r["val_loss"] for r in reference["history"] if r.get("val_loss") is not None)
    _, reference_s = seconds_to(reference["history"], target)
    rows = []
    for name, r in runs.items():
        step, secs = seconds_to(r["history"], target)
        rows.append(
            {
                "recipe": name,
                "overrides": recipes(muon_lr, args.other_muon_lrs)[name],
                "steps": args.steps,
                "train_s": r["train_s"],
                "tokens_per_sec": round(statistics.median(h["tokens_per_sec"] for h in r["history"])),
                "val_bits_per_byte": r["val_bits_per_byte"],
                "test_bits_per_byte": r["test_bits_per_byte"],
                "best_val_loss": min(h["val_loss"] for h in r["history"] if h.get("val_loss") is not None),
                "step_at_baseline_loss": step,
                "seconds_to_baseline_loss": secs,
            }
        )
    first = rows[0]
    for row in rows:
        row["test_ratio"] = row["test_bits_per_byte"] / first["test_bits_per_byte"]
        row["tokens_per_sec_ratio"] = row["tokens_per_sec"] / first["tokens_per_sec"]
        secs = row["seconds_to_baseline_loss"]
        row["time_to_baseline_loss_ratio"] = None if secs is None else secs / reference_s

    print(f"\n{args.corpus}, {args.steps} steps; ratios vs {BASELINE}; baseline's best val loss {target:.4f}")
    print(
        f"{'recipe':<16} {'train s':>8} {'tok/s':>7} {'x tok/s':>8} {'val b/B':>8} {'test b/B':>9} "
        f"{'x test':>7} {'step@base':>9} {'x time':>7}"
    )
    for r in rows:
        ratio = r["time_to_baseline_loss_ratio"]
        print(
            f"{r['recipe']:<16} {r['train_s']:>8} {r['tokens_per_sec']:>7} {r['tokens_per_sec_ratio']:>8.3f} "
            f"{r['val_bits_per_byte']:>8.4f} {r['test_bits_per_byte']:>9.4f} {r['test_ratio']:>7.3f} "
            f"{r['step_at_baseline_loss'] or '-':>9} {'-' if ratio is None else f'{ratio:.3f}':>7}"
        )
    tokens_per_step = base["train"]["batch_size"] * base["model"]["max_seq_len"]
    train_step_ms = 1000 * tokens_per_step / first["tokens_per_sec"]
    extra_ms = step_ms["muon"] - step_ms["adamw"]
    print(
        f"optimizer step: AdamW {step_ms['adamw']} ms, Muon + AdamW {step_ms['muon']} ms (+{extra_ms:.1f} ms, "
        f"{100 * extra_ms / train_step_ms:.1f}% of the baseline's {train_step_ms:.0f} ms training step)"
    )
    load_after = os.getloadavg()
    result = {
        "optimizer_step_ms": step_ms,
        "baseline_train_step_ms": round(train_step_ms, 1),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "muon_lr": muon_lr,
        "baseline_best_val_loss": target,
        "rows": rows,
        "load_average_before_after": [load_before[0], load_after[0]],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), **cpu()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
