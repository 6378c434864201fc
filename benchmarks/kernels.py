"""lmops' few-row product kernel, called alone, against MKL's product.

    python benchmarks/kernels.py [--rows 1 2 5] [--threads 1 2] [--working-set-mb 12] [--out F]

For each product of the default model's decode step (QKV 320x192, O 192x192, gate/up
1024x192, down 192x512, the LM head 4096x192) over 1 row (a decode step), 2, and 5 rows (a
verification of 4 drafts): `lmops::small_linear` on the weight packed for it
(`kernels.pack_weight`) and `aten.mm` (MKL, as `F.linear` eagerly), each called from Python
through torch's dispatcher (the same few microseconds of overhead each). A step reads
every weight once, about 9 MiB for the default model, more than a core's L2 holds: so each
call reads the next of several copies of its weight, `--working-set-mb` in all (the
weights come from L3 or memory, as in a step, not from L2 as in a loop over one weight).
Microseconds a call (the best of 5 x `--calls` calls), aten.mm's time over the kernel's, and
the rate each reads its weight at; writes benchmarks/results/kernels-cpu.json. What the
kernel gains inside a decode graph (against inductor's loop, where it is not built) is
benchmarks/single_stream.py's to measure.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import RESULTS, cpu_description, write_results  # noqa: E402

from lmops.runtime.engine import kernels  # noqa: E402
from lmops.runtime.model_config import LlamaConfig  # noqa: E402

DEFAULT = LlamaConfig(vocab_size=4096)  # the default model (benchmarks/engine.py's random one)
# (out, in) of each product of its decode step: fused Q/K/V, O, fused gate/up, down, LM head.
SHAPES = {
    "qkv": ((DEFAULT.n_head + 2 * DEFAULT.n_kv_heads) * DEFAULT.head_dim, DEFAULT.n_embd),
    "o": (DEFAULT.n_embd, DEFAULT.n_head * DEFAULT.head_dim),
    "gate_up": (2 * DEFAULT.intermediate_size, DEFAULT.n_embd),
    "down": (DEFAULT.n_embd, DEFAULT.intermediate_size),
    "lm_head": (DEFAULT.vocab_size, DEFAULT.n_embd),
}


def best_us(call, copies: int, calls: int) -> float:
    """The best of 5 timings of `calls` calls, each on the next copy, in microseconds a call."""
    for i in range(20):
        call(i % copies)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for i in range(calls):
            call(i % copies)
        times.append((time.perf_counter() - t) / calls * 1e6)
    return min(times)


def measure(rows: int, n: int, k: int, working_set: int, calls: int) -> dict:
    copies = max(1, working_set // (n * k * 4))
    weights = [torch.randn(n, k) for _ in range(copies)]
    blocks = [kernels.pack_weight(w) for w in weights]
    x = torch.randn(rows, k)
    torch.testing.assert_close(
        torch.ops.lmops.small_linear(x, blocks[0], n), F.linear(x, weights[0]), rtol=1e-5, atol=1e-4
    )
    us = {
        "kernel": best_us(lambda i: torch.ops.lmops.small_linear(x, blocks[i], n), copies, calls),
        "aten_mm": best_us(lambda i: F.linear(x, weights[i]), copies, calls),
    }
    return {"us": us, "copies": copies, "gb_per_s": {p: n * k * 4 / t / 1e3 for p, t in us.items()}}


def table(result: dict) -> str:
    lines = [
        f"{result['cpu']}; weights cycling through {result['working_set_mb']} MiB",
        "| threads | product | rows | kernel us (GB/s) | aten.mm us (GB/s) | aten.mm / kernel |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        us, rate = row["us"], row["gb_per_s"]
        lines.append(
            f"| {row['threads']} | {row['product']} {row['n']}x{row['k']} | {row['rows']} "
            f"| {us['kernel']:.1f} ({rate['kernel']:.0f}) | {us['aten_mm']:.1f} ({rate['aten_mm']:.0f}) "
            f"| {us['aten_mm'] / us['kernel']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--working-set-mb", type=int, default=12)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--out", type=Path, default=RESULTS / "kernels-cpu.json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lmops-kernels-") as build:  # loaded, the library may go
        if not kernels.load_kernels(Path(build), "benchmark"):
            raise SystemExit("lmops' kernels are not built on this CPU (they need AVX2 and FMA)")
    result = {
        "cpu": cpu_description(),
        "working_set_mb": args.working_set_mb,
        "torch": torch.__version__,
        "rows": [],
    }
    for threads in args.threads:
        torch.set_num_threads(threads)
        for product, (n, k) in SHAPES.items():
            for rows in args.rows:
                m = measure(rows, n, k, args.working_set_mb << 20, args.calls)
                result["rows"].append(
                    {"threads": threads, "product": product, "n": n, "k": k, "rows": rows, **m}
                )
    print(table(result))
    write_results(result, args.out)
    return result


if __name__ == "__main__":
    main()
