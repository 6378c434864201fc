"""int8 weight-only quantization against float32: decode speed, batched throughput, prefill.

    python benchmarks/quantize.py [--quick] [--threads 1] [--out benchmarks/results/quantize-cpu.json]

The model is issue 14's 25M-parameter shape (8 layers, 512 wide, 8 heads over 4 KV heads,
MLP 1376, vocab 4096) with random weights: speed does not depend on what the weights say.
Both columns run in this process, on the same prompts, alternating per round (medians),
so load from other jobs falls on both alike. Greedy, EOS ignored. Workloads:
  A  1 request, 128-token prompt, 128 new tokens: decode tokens/s and ms per step.
  B  64 requests, prompts 16-512 tokens, 128 new tokens: output tokens/s.
  P  one 512-token prompt: time to first token (prefill: the dequantizing GEMM path).
Before them, a micro-benchmark of one linear per weight shape of the model, float32 against
each of the int8 linear's two paths (the int8 kernel, the dequantizing GEMM, forced by
setting `lmops.runtime.quantize.GEMM_ROWS`), at 1 to 512 rows: where the crossover lies.
The quality cost (bits/byte on held-out text) is measured on a trained model by
benchmarks/quality.py, which reports float32 and int8 side by side.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from engine import RESULTS, cpu_description, write_results

import lmops.runtime.quantize
from lmops.pipeline.random_model import random_model_dir
from lmops.runtime.engine import LLMEngine, SamplingParams
from lmops.runtime.quantize import Int8Weight

REPO = Path(__file__).resolve().parents[1]
SHAPE = {"n_layer": 8, "n_embd": 512, "n_head": 8, "n_kv_heads": 4, "intermediate_size": 1376}
TARGETS = {"A": 1.8, "B": 1.3}  # int8 over float32 (issue 14)
# (out, in) of each linear: fused q/k/v, o, fused gate/up, down, LM head.
LINEARS = {
    "qkv": (1024, 512),
    "o": (512, 512),
    "gate_up": (2752, 512),
    "down": (512, 1376),
    "lm_head": (4096, 512),
}
ROWS = (1, 2, 4, 8, 12, 16, 20, 24, 32, 64, 128, 256, 512)


def build_model(directory: Path) -> Path:
    # A 4096-token BPE on this repository's own sources: the ids only have to decode.
    texts = [p.read_text(encoding="utf-8") for p in sorted((REPO / "src").rglob("*.py"))]
    return random_model_dir(directory, texts, 4096, 1024, seed=0, **SHAPE)


def greedy(new: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)


def best_ms(fn, *args, seconds: float = 0.05) -> float:
    """Fastest time of `fn(*args)` over `seconds` (other jobs on the box only add time)."""
    fn(*args)
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 3:
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return 1000 * min(times)


def linear_table(rows: tuple[int, ...], rounds: int = 4) -> dict:
    """ms per product for each shape and row count: float32, the int8 kernel, the int8 GEMM,
    the three alternating for `rounds` rounds (fastest counts), so bursts of load fall on all."""
    torch.manual_seed(0)
    table, threshold = {}, lmops.runtime.quantize.GEMM_ROWS
    for name, (n_out, n_in) in LINEARS.items():
        w = torch.randn(n_out, n_in) * 0.05
        qw = Int8Weight.from_float(w)
        for m in rows:
            x = torch.randn(m, n_in)
            row = {"float32": math.inf, "int8_kernel": math.inf, "int8_gemm": math.inf}
            for _ in range(rounds):
                row["float32"] = min(row["float32"], best_ms(F.linear, x, w))
                for path, gemm_rows in (("int8_kernel", m + 1), ("int8_gemm", 0)):
                    lmops.runtime.quantize.GEMM_ROWS = gemm_rows
                    row[path] = min(row[path], best_ms(F.linear, x, qw))
                lmops.runtime.quantize.GEMM_ROWS = threshold
            table.setdefault(name, {})[m] = row
    return table


def print_linear_table(table: dict) -> None:
    print("\none linear, ms: float32 / int8 kernel / int8 GEMM", end="")
    print(f" (int8 takes the GEMM from {lmops.runtime.quantize.GEMM_ROWS} rows on)")
    print("rows " + "".join(f"{name:>22s}" for name in table))
    for m in next(iter(table.values())):
        cells = ("/".join(f"{v:.3g}" for v in table[name][m].values()) for name in table)
        print(f"{m:4d} " + "".join(f"{c:>22s}" for c in cells))


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
    ap.add_argument(
        "--rounds", type=int, default=5, help="alternating rounds, medians (default: %(default)s)"
    )
    ap.add_argument("--out", type=Path, help="JSON path (default results/quantize-cpu[-quick].json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    new, n_b, rounds = (32, 16, 1) if args.quick else (128, 64, args.rounds)
    linears = linear_table(ROWS[::3] if args.quick else ROWS)
    print_linear_table(linears)
    rng = random.Random(2)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp))
        # No prefix cache: every round re-sends the same prompts, which would otherwise be
        # prefilled only in the first (B and P then measured decode and a cache hit).
        engines = {
            q: LLMEngine.from_pretrained(model_dir, device="cpu", quantization=q, enable_prefix_caching=False)
            for q in (None, "int8")
        }
    V = engines[None].model_config.vocab_size
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
        "linear_ms": linears,
        "gemm_rows": lmops.runtime.quantize.GEMM_ROWS,
        "rounds_raw": {("int8" if q else "float32"): rs for q, rs in rows.items()},
        "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "cpu": cpu_description(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
    }
    write_results(result, args.out or RESULTS / f"quantize-cpu{'-quick' if args.quick else ''}.json")
    return result


if __name__ == "__main__":
    main()
