"""The training recipe (issue 32): the recipe before it (AdamW, warmup + cosine, no dropout,
Llama's layout, windows at random starts) against params.yaml's defaults and variants of
them (Muon with cosine or wsd, an untied head, QK-norm or not, a ReLU² MLP, random
windows), at equal steps, in the same run.

    python benchmarks/recipe.py [--steps 300] [--max-bytes 8000000] [--corpus stdlib|shakespeare]
        [--recipes NAME ...] [--muon-lr LR] [--other-muon-lrs LR ...] [--eval-interval 25] [--seed 1337]
        [--set SECTION.KEY=VALUE ...]
        [--out benchmarks/results/recipe-cpu.json]

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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from gate import cpu, lmops

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
BASELINE = "adamw + cosine"


def recipes(muon_lr: float, other_lrs: list[float]) -> dict[str, dict]:
    """Each recipe's overrides of params.yaml, by section (the first is the baseline: the
    recipe before issue 32, whatever params.yaml says now); "defaults" is params.yaml as it is."""
    muon = {"optimizer": "muon", "muon_lr": muon_lr}
    return {
        BASELINE: {
            "train": {"optimizer": "adamw", "lr_schedule": "cosine", "weight_decay": 0.1},
            "model": {"dropout": 0.0, "qk_norm": False},
            "ablation": "random_windows",
        },
        "defaults": {},
        "muon + cosine": {"train": {**muon, "lr_schedule": "cosine"}},
        "muon + wsd": {"train": {**muon, "lr_schedule": "wsd"}},
        **{
            f"muon + wsd, lr {lr:g}": {"train": {**muon, "muon_lr": lr, "lr_schedule": "wsd"}}
            for lr in other_lrs
        },
        "untied head": {"model": {"tie_embeddings": False}},
        "zero-init projections": {"ablation": "zero_init"},
        "relu2 mlp": {"ablation": "relu2"},
        "random windows": {"ablation": "random_windows"},
        "qk-norm": {"model": {"qk_norm": True}},
        "llama layout": {"model": {"qk_norm": False}},
    }


def base_params(args: argparse.Namespace) -> dict:
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    if args.corpus == "shakespeare":
        base["data"].update(source=str(SHAKESPEARE), max_bytes=None, sha256=None)
        base["split"].update(method="tail")
    elif args.max_bytes:
        base["data"]["max_bytes"] = args.max_bytes
    for setting in args.set:  # every recipe's params, tokenizer.vocab_size too
        key, _, value = setting.partition("=")
        section, _, name = key.partition(".")
        base[section][name] = yaml.safe_load(value)
    base["mlflow"]["tracking_uri"] = "sqlite:///mlflow.db"
    base["train"].update(
        max_steps=args.steps,
        checkpoint_interval=args.steps,
        eval_interval=args.eval_interval,
        threads=args.threads,
        seed=args.seed,
    )
    return base


def train_and_score(work: Path, base: dict, overrides: dict) -> dict:
    """Train one recipe from scratch in `work` and score its export (in a worker process of its
    own: an ablation patches the network there, and nowhere else)."""
    params = json.loads(json.dumps(base))
    for section, values in overrides.items():
        if section != "ablation":
            params[section].update(values)
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.rmtree(work / "artifacts/checkpoints", ignore_errors=True)  # a fresh run, not a resume
    shutil.rmtree(work / "artifacts/checkpoints-before-cooldown", ignore_errors=True)
    ablation = overrides.get("ablation", "none")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--worker", ablation], cwd=work, check=True)
    seconds = time.perf_counter() - t0
    history = json.loads((work / "artifacts/checkpoints/state.json").read_text())["history"]
    return {"train_s": round(seconds, 1), "history": history, **json.loads((work / "bits.json").read_text())}


# Ablations (issue 32) that params.yaml does not offer: each patches lmops' network or its
# batches in the worker alone, so nothing ships until it measures better.
def zero_init_projections() -> None:
    """modded-nanogpt's zero-initialised output projections (o_proj, down_proj): every layer
    starts as the identity on the residual stream."""
    from lmops.runtime import model

    init = model.Llama.__init__

    def patched(self, cfg):
        init(self, cfg)
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                torch.nn.init.zeros_(p)

    model.Llama.__init__ = patched


def relu_squared_mlp() -> None:
    """modded-nanogpt's and nanochat's MLP, down(relu(up(x))^2), in place of SwiGLU, at the same
    parameters and compute: 1.5x the hidden width for two matrices instead of three (the layout
    of transformers' ArceeMLP and ApertusMLP with hidden_act "relu2")."""
    from lmops.runtime import model

    def init(self, cfg):
        torch.nn.Module.__init__(self)
        hidden = cfg.intermediate_size * 3 // 2
        self.up_proj = torch.nn.Linear(cfg.n_embd, hidden, bias=False)
        self.down_proj = torch.nn.Linear(hidden, cfg.n_embd, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x):
        y = self.down_proj(torch.relu(self.up_proj(x)).square())
        return torch.nn.functional.dropout(y, self.dropout, self.training)

    model.MLP.__init__, model.MLP.forward = init, forward


def random_windows() -> None:
    """The training windows before epochs (issue 32): each at a random start, drawn with
    replacement, seeded by (seed, step, micro-step, rank); the worker's runs have one
    process and no accumulation, so a batch's step is its first window over its size."""
    import numpy as np

    from lmops.pipeline import train

    def batch(tokens, max_seq_len, size, seed, first, device):
        rng = np.random.default_rng((seed, first // size, 0, 0))
        return train.windows(
            tokens, rng.integers(0, len(tokens) - max_seq_len - 1, size), max_seq_len, device
        )

    train.batch = batch


ABLATIONS = {
    "none": lambda: None,
    "zero_init": zero_init_projections,
    "relu2": relu_squared_mlp,
    "random_windows": random_windows,
}


def worker(ablation: str) -> None:
    """In the project directory: `lmops train` under the ablation, then val and test bits/byte of
    the export, loaded by the same (patched) network, to bits.json."""
    ABLATIONS[ablation]()
    from lmops.pipeline import cli
    from lmops.pipeline.evaluate import score
    from lmops.runtime.model import Llama
    from lmops.runtime.tokenizer import chunks, load_tokenizer

    if cli.main(["train"]) != 0:
        raise SystemExit("lmops train failed")
    model_dir = Path("artifacts/model")
    model, tokenizer = Llama.from_pretrained(model_dir), load_tokenizer(model_dir)
    bits = {
        f"{split}_bits_per_byte": score(
            model, tokenizer, chunks(Path(f"data/processed/{split}.txt").read_text())
        )["bits_per_byte"]
        for split in ("val", "test")
    }
    Path("bits.json").write_text(json.dumps(bits))


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
    from lmops.pipeline.optim import make_optimizer
    from lmops.pipeline.params import TrainConfig
    from lmops.pipeline.train import WEIGHT_DECAY
    from lmops.runtime.model import Llama
    from lmops.runtime.model_config import LlamaConfig

    model = Llama(LlamaConfig(vocab_size=vocab_size, **{**base["model"], "dropout": 0.0}))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opts = {
        o: make_optimizer(model, TrainConfig(optimizer=o, weight_decay=WEIGHT_DECAY), torch.device("cpu"))
        for o in ("adamw", "muon")
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
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2])
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--max-bytes", type=int, default=8_000_000, help="of the stdlib corpus; 0 = params.yaml's (all of it)"
    )
    parser.add_argument("--corpus", choices=("stdlib", "shakespeare"), default="stdlib")
    parser.add_argument("--muon-lr", type=float, default=None, help="default: params.yaml's train.muon_lr")
    parser.add_argument("--other-muon-lrs", type=float, nargs="*", default=[], help="muon + wsd at these too")
    parser.add_argument(
        "--eval-interval", type=int, default=25, help="train.eval_interval: the curve's resolution"
    )
    parser.add_argument(
        "--recipes",
        nargs="+",
        default=["muon + cosine", "muon + wsd"],
        choices=[r for r in recipes(0.0, []) if r != BASELINE],
        help="beside the baseline (adamw + cosine, no dropout)",
    )
    parser.add_argument(
        "--baseline-from",
        type=Path,
        help="an earlier run's JSON of the same corpus: its baseline row instead of training it again",
    )
    parser.add_argument(
        "--no-baseline", action="store_true", help="the recipes alone (ratios against the first of them)"
    )
    parser.add_argument("--threads", type=int, default=0, help="train.threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=1337, help="train.seed (init, batches, dropout)")
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="params.yaml values for every recipe, e.g. tokenizer.vocab_size=1024 model.dropout=0.1",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/recipe-cpu.json")
    args = parser.parse_args()
    earlier = json.loads(args.baseline_from.read_text()) if args.baseline_from else None
    if earlier and (earlier["args"]["corpus"], earlier["args"]["max_bytes"]) != (args.corpus, args.max_bytes):
        parser.error(f"--baseline-from {args.baseline_from}: another corpus ({earlier['args']})")
    same_seed = (earlier or {}).get("args", {}).get("seed", 1337) == args.seed
    if earlier and not (same_seed and earlier["args"].get("set", []) == args.set):
        parser.error(f"--baseline-from {args.baseline_from}: another seed or --set ({earlier['args']})")
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
            name: train_and_score(work, base, o)
            for name, o in recipes(muon_lr, args.other_muon_lrs).items()
            if (name == BASELINE and earlier is None and not args.no_baseline)
            or name in args.recipes
            or name.startswith("muon + wsd, lr")
        }
        vocab_size = json.loads((work / "artifacts/tokenizer/stats.json").read_text())["vocab_size"]
        step_ms = optimizer_step_ms(base, vocab_size)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    tokens_per_step = base["train"]["batch_size"] * base["model"]["max_seq_len"]
    if earlier is None:
        reference = next(iter(runs.values()))  # the baseline, or with --no-baseline the first recipe
        target = min(r["val_loss"] for r in reference["history"] if r.get("val_loss") is not None)
        _, reference_s = seconds_to(reference["history"], target)
        rows = []
    else:  # the earlier run's baseline: training on CPU repeats bit for bit on one machine
        target = earlier["baseline_best_val_loss"]
        rows = [
            {**next(r for r in earlier["rows"] if r["recipe"] == BASELINE), "from": str(args.baseline_from)}
        ]
        reference_s = rows[0]["seconds_to_baseline_loss"]
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
    train_step_ms = 1000 * tokens_per_step / first["tokens_per_sec"]
    extra_ms = step_ms["muon"] - step_ms["adamw"]
    for row in rows:  # each step's cost against an AdamW step (the baseline's, when it is there)
        optimizer = row["overrides"].get("train", {}).get("optimizer", base["train"]["optimizer"])
        muon = row["recipe"] != BASELINE and optimizer == "muon"
        row["step_cost_ratio"] = (train_step_ms + extra_ms) / train_step_ms if muon else 1.0
    for row in rows:
        row["test_ratio"] = row["test_bits_per_byte"] / first["test_bits_per_byte"]
        row["tokens_per_sec_ratio"] = row["tokens_per_sec"] / first["tokens_per_sec"]
        secs = row["seconds_to_baseline_loss"]
        row["time_to_baseline_loss_ratio"] = None if secs is None else secs / reference_s
        # The same from step counts and the interleaved optimizer timing, which other jobs on
        # the box do not skew: steps to the baseline's loss x each step's cost, against the first's.
        step, cost = row["step_at_baseline_loss"], row["step_cost_ratio"] / first["step_cost_ratio"]
        row["steps_x_cost_to_baseline_loss_ratio"] = (
            None if step is None else step * cost / first["step_at_baseline_loss"]
        )

    print(f"\n{args.corpus}; ratios vs {first['recipe']}, whose best val loss is {target:.4f}")
    print(
        f"{'recipe':<22} {'steps':>5} {'train s':>8} {'tok/s':>7} {'x tok/s':>8} {'val b/B':>8} {'test b/B':>9} "
        f"{'x test':>7} {'step@base':>9} {'x time':>7} {'x steps*cost':>12}"
    )
    for r in rows:
        ratio, by_steps = r["time_to_baseline_loss_ratio"], r["steps_x_cost_to_baseline_loss_ratio"]
        print(
            f"{r['recipe']:<22} {r['steps']:>5} {r['train_s']:>8} {r['tokens_per_sec']:>7} "
            f"{r['tokens_per_sec_ratio']:>8.3f} {r['val_bits_per_byte']:>8.4f} {r['test_bits_per_byte']:>9.4f} "
            f"{r['test_ratio']:>7.3f} {r['step_at_baseline_loss'] or '-':>9} "
            f"{'-' if ratio is None else f'{ratio:.3f}':>7} {'-' if by_steps is None else f'{by_steps:.3f}':>12}"
        )
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
