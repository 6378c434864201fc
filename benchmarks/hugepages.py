"""The model's weight products on huge pages against ordinary ones, in one run.

    python benchmarks/hugepages.py [--threads 1] [--rounds 9]

A decode step at batch 1 streams every weight once: the default model's 17 products (4 layers
of fused q/k/v, o, fused gate/up and down, then the LM head), 9.4 MB. Each layout runs the
same chain of those products through forward.py's `linear` in one compiled graph (inductor's
own loop, as in the decode graph), each product's input taken from the one before; the
weights either as torch allocated them (`ordinary`: its heap, 4 KiB pages) or moved by
`move_to_huge_pages` into memory advised MADV_HUGEPAGE (`huge pages`). The layouts take turns
for `--rounds` rounds (medians). Prints a table and writes benchmarks/results/hugepages-cpu.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from engine import RESULTS, cpu_description, write_results

from lmops.runtime.engine.forward import linear
from lmops.runtime.hugepages import move_to_huge_pages
from lmops.runtime.model_config import LlamaConfig


def product_shapes(cfg: LlamaConfig) -> list[tuple[int, int]]:
    """(out, in) of each product of a decode step, in order."""
    qkv = (cfg.n_head + 2 * cfg.n_kv_heads) * cfg.head_dim
    layer = [(qkv, cfg.n_embd), (cfg.n_embd, cfg.n_head * cfg.head_dim)]
    layer += [(2 * cfg.intermediate_size, cfg.n_embd), (cfg.n_embd, cfg.intermediate_size)]
    return layer * cfg.n_layer + [(cfg.vocab_size, cfg.n_embd)]


def chain(weights: list[torch.Tensor]):
    """One token's products, each input the previous output cut or tiled to its width."""

    def run(x: torch.Tensor) -> torch.Tensor:
        for w in weights:
            n_in = w.shape[1]
            x = linear(x.repeat(1, -(-n_in // x.shape[1]))[:, :n_in], w)
        return x

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=300, help="chain calls a round")
    ap.add_argument("--out", type=Path, default=RESULTS / "hugepages-cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096)  # the default shape and BPE (params.yaml)
    shapes = product_shapes(cfg)
    weights = [torch.randn(n, k) * k**-0.5 for n, k in shapes]
    moved = [w.clone() for w in weights]
    move_to_huge_pages(moved)
    layouts = {
        name: torch.compile(chain(ws), fullgraph=True)
        for name, ws in (("ordinary", weights), ("huge pages", moved))
    }
    x = torch.randn(1, cfg.n_embd)
    outs = [f(x) for f in layouts.values()]
    assert torch.equal(outs[0], outs[1]), "the layouts computed different products"
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for _ in range(args.rounds):
        for name, f in layouts.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                f(x)
            times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    base = statistics.median(times["ordinary"])
    res = {
        "cpu": cpu_description(),
        "threads": args.threads,
        "products": len(shapes),
        "weight_mb": sum(n * k for n, k in shapes) * 4 / 1e6,
        "us_per_token": {name: statistics.median(t) for name, t in times.items()},
        "rounds_us": times,
    }
    print(f"{res['products']} products, {res['weight_mb']:.1f} MB, {args.threads} thread(s), {res['cpu']}")
    print("| weights | us a token (one graph call) | vs ordinary |\n|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t):.1f} | {base / statistics.median(t):.2f}x |")
    write_results(res, args.out)


if __name__ == "__main__":
    main()
