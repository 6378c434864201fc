"""int8 weight-only quantization against float32: decode speed, batched throughput, prefill.

    python benchmarks/quantize.py [--quick] [--threads 1] [--out benchmarks/results/quantize-cpu.json]

The model is issue 14's 25M-parameter shape (8 layers, 512 wide, 8 heads over 4 KV heads,
MLP 1376, vocab 4096) with random weights: speed does not depend on what the weights say.
Both columns run in this process, on the same prompts, alternating per round (medians),
so load from other jobs falls on both alike. Greedy, EOS ignored. Workloads:
  A  1 request, 128-token prompt, 128 new tokens: decode tokens/s and ms per step.
  B  64 requests, prompts 16-512 tokens, 128 new tokens: output tokens/s.
  P  one 512-token prompt: time to first token (prefill through the int8 kernel).
The quality cost (bits/byte on held-out text) is measured on a trained model by
benchmarks/quality.py, which reports float32 and int8 side by side.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from engine import RESULTS, write_results

from lmops.engine import LLMEngine, SamplingParams
from lmops.random_model import random_model_dir

REPO = Path(__file__).resolve().parents[1]
SHAPE = {"n_layer": 8, "n_embd": 512, "n_head": 8, "n_kv_heads": 4, "intermediate_size": 1376}
TARGETS = {"A": 1.8, "B": 1.3}  # int8 over float32 (issue 14)


def build_model(directory: Path) -> Path:
    # A 4096-token BPE on this repository's own sources: the ids only have to decode.
    texts = [p.read_text(encoding="utf-8") for p in sorted((REPO / "src").rglob("*.py"))]
    return random_model_dir(directory, texts, 4096, 1024, seed=0, **SHAPE)


def greedy(new: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)


def run_round(engine: LLMEngine, prompts: dict, new: int) -> dict:
    a = engine.generate([prompts["A"]], greedy(new))[0].metrics
    t = time.perf_counter()
    outs = engine.generate(prompts["B"], greedy(new))
    b = len(outs) * new / (time.perf_counter() - t)
    p = engine.generate([prompts["P"]], greedy(1))[0].metrics
    return {
        "A_decode_tok_s": (new - 1) / (a.last_token_time - a.first_token_time),
        "B_tok_s": b,
        "P_ttft_ms": 1000 * p.ttft,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 requests in B, 32 new tokens, 1 round")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, help="JSON path (default results/quantize-cpu[-quick].json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    new, n_b, rounds = (32, 16, 1) if args.quick else (128, 64, args.rounds)
    rng = random.Random(2)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp))
        engines = {
            q: LLMEngine.from_pretrained(model_dir, device="cpu", quantization=q) for q in (None, "int8")
        }
    V = engines[None].config.vocab_size
    prompts = {
        "A": [rng.randrange(3, V) for _ in range(128)],
        "B": [[rng.randrange(3, V) for _ in range(rng.randint(16, 512))] for _ in range(n_b)],
        "P": [rng.randrange(3, V) for _ in range(512)],
    }
    for engine in engines.values():
        engine.generate([prompts["A"][:20]], greedy(4))  # warm-up
    load_before = os.getloadavg()[0]
    rows = {q: [] for q in engines}
    for _ in range(rounds):
        for q, engine in engines.items():
            rows[q].append(run_round(engine, prompts, new))
    med = {
        "int8" if q else "float32": {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        for q, rs in rows.items()
    }
    f, i = med["float32"], med["int8"]
    ratios = {
        "A_decode": i["A_decode_tok_s"] / f["A_decode_tok_s"],
        "B_throughput": i["B_tok_s"] / f["B_tok_s"],
        "P_prefill": f["P_ttft_ms"] / i["P_ttft_ms"],
    }
    params = sum(p.numel() for p in engines[None].model.parameters())
    print(
        f"\n25M model ({params / 1e6:.1f}M params), CPU, {torch.get_num_threads()} thread(s), {rounds} round(s)"
    )
    print(f"{'workload':34s} {'float32':>10s} {'int8':>10s} {'int8/fp32':>10s} {'target':>7s}")
    for label, key, ratio, target in (
        ("A decode tok/s (1 stream)", "A_decode_tok_s", ratios["A_decode"], TARGETS["A"]),
        (f"B output tok/s ({n_b} requests)", "B_tok_s", ratios["B_throughput"], TARGETS["B"]),
        ("P TTFT ms (512-token prompt)", "P_ttft_ms", ratios["P_prefill"], None),
    ):
        t = f">={target}" if target else ""
        print(f"{label:34s} {f[key]:10.1f} {i[key]:10.1f} {ratio:9.2f}x {t:>7s}")
    result = {
        "model": {"params": params, **SHAPE, "vocab_size": V},
        "threads": torch.get_num_threads(),
        "quick": args.quick,
        "rounds": rounds,
        "new_tokens": new,
        "B_requests": n_b,
        "float32": med["float32"],
        "int8": med["int8"],
        "int8_over_float32": ratios,
        "targets": TARGETS,
        "rounds_raw": {("int8" if q else "float32"): rs for q, rs in rows.items()},
        "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "cpu": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
    }
    write_results(result, args.out or RESULTS / f"quantize-cpu{'-quick' if args.quick else ''}.json")
    return result


if __name__ == "__main__":
    main()
