"""What the drift signal costs: engine throughput with prompt scoring off, at the default
sample rate (0.1) and on every request (1.0), in the same run.

    python benchmarks/drift.py [--model DIR] [--quick] [--device auto|cpu|cuda] [--rounds N]

Two workloads, all requests submitted at once, greedy, EOS ignored:
  mixed   64 requests, prompts 16-512 tokens, 32 new tokens (scoring adds LM-head rows
          for the sampled prompts' tokens)
  prefix  32 requests sharing a 512-token prefix + 16 own tokens, 16 new tokens (a sampled
          request also gives up its prefix-cache hit: its whole prompt is prefilled)
Each rate gets its own engine; the rates alternate for `--rounds` rounds and the best
wall time counts (other jobs on a shared machine only ever add time). Every round brings
new prompts of the same lengths; only the shared prefix stays cached, as in steady serving. Model: as benchmarks/engine.py (random default size, context 1024).
Prints a table; writes benchmarks/results/drift-<device>.json.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from engine import RESULTS, build_random_model, cpu_description, greedy, make_engine, sync, write_results

from lmops.runtime.engine.config import EngineConfig
from lmops.runtime.model import default_dtype, resolve_device

RATES = (0.0, EngineConfig().drift_sample, 1.0)


def workloads(vocab: int, ctx: int, quick: bool, rounds: int) -> dict[str, tuple[list[list[list[int]]], int]]:
    """Per workload: one prompt list per round (new token ids each round, the same lengths,
    so no round finds another's prompts cached; only the shared prefix stays), new tokens."""
    rng = random.Random(4)
    lengths = [rng.randint(16, min(512, ctx - 32)) for _ in range(16 if quick else 64)]
    prefix = [rng.randrange(3, vocab) for _ in range(min(512, ctx - 32))]

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    return {
        "mixed": ([[ids(n) for n in lengths] for _ in range(rounds)], 32),
        "prefix": ([[prefix + ids(16) for _ in range(8 if quick else 32)] for _ in range(rounds)], 16),
    }


def measure(engines: dict[float, object], rounds: list[list[list[int]]], new: int) -> dict:
    seconds = {rate: [] for rate in engines}
    for prompts in rounds:
        for rate, engine in engines.items():
            t = time.perf_counter()
            outs = engine.generate(prompts, greedy(new))
            sync(engine.device)
            seconds[rate].append(time.perf_counter() - t)
            assert all(len(o.token_ids) == new for o in outs)
    prompts = rounds[0]
    tokens = sum(len(p) + new for p in prompts)
    base = min(seconds[0.0])
    return {
        "requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "new_tokens": new,
        "by_rate": {
            str(rate): {
                "seconds_rounds": s,
                "tokens_per_s": tokens / min(s),
                "throughput_vs_off": base / min(s),
                "scored_prompts": engines[rate].metrics.registry.get_sample_value(
                    "lmops:prompt_bits_per_byte_count"
                ),
            }
            for rate, s in seconds.items()
        },
    }


def table(res: dict) -> str:
    lines = [
        "| workload | drift_sample | prompt+output tokens/s | throughput vs off |",
        "|---|---|---|---|",
    ]
    for name in ("mixed", "prefix"):
        for rate, r in res[name]["by_rate"].items():
            lines.append(f"| {name} | {rate} | {r['tokens_per_s']:.0f} | {r['throughput_vs_off']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="model directory (default: random model of the default size)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true", help="fewer requests, one round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (as benchmarks/engine.py)")
    ap.add_argument("--out", type=Path, help="JSON path (default results/drift-<device>.json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_random_model(Path(tmp), 1024)
        engines = {rate: make_engine(model_dir, args.device, drift_sample=rate) for rate in RATES}
        some = engines[0.0]
        res = {
            "model": str(args.model or "random init, default size, context 1024"),
            "device": str(device),
            "dtype": str(default_dtype(device)),
            "threads": torch.get_num_threads(),
            "cpu": cpu_description(),
            "torch": torch.__version__,
            "rounds": 1 if args.quick else args.rounds,
        }
        load_before = os.getloadavg()  # 1-minute averages: was anything else running?
        for name, (rounds, new) in workloads(
            some.model_config.vocab_size, some.max_model_len, args.quick, res["rounds"]
        ).items():
            print(f"{name}: {len(rounds[0])} requests", file=sys.stderr)
            res[name] = measure(engines, rounds, new)
        res["load_average_before_after"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    print(table(res))
    write_results(res, args.out or RESULTS / f"drift-{device.type}{'-quick' if args.quick else ''}.json")
    return res


if __name__ == "__main__":
    main()
