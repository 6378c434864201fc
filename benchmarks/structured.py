"""Structured outputs: grammar compile times, mask time per token, and output tokens/s with
half the batch constrained by a nested JSON schema against the same batch unconstrained.

    python benchmarks/structured.py [--quick] [--threads 1] [--device cpu] [--out ...]

The model is the default size with random weights (benchmarks/engine.py's). Compile: each
spec compiled cold by a fresh GrammarCompiler (the tokenizer it builds first is timed
apart). Masks: `fill_masks` over R matchers midway through the nested schema, per matcher.
Throughput: B requests of 64-token prompts, max_tokens new tokens, temperature 1; "plain"
ignores EOS, "half" constrains every second request to SCHEMA (long bounded strings, so the
outputs run most of max_tokens; the others as in plain). The two alternate per round
(medians), so load from other jobs falls on both alike; target half/plain >= 0.8 (issue 33).
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
from engine import RESULTS, build_random_model, write_results

from lmops.runtime.engine import LLMEngine, SamplingParams
from lmops.runtime.engine.grammar import GrammarCompiler, StructuredOutputs

TARGET = 0.8
WORD = {"type": "string", "maxLength": 24}
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 10**6},
        "user": {
            "type": "object",
            "properties": {
                "name": WORD,
                "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,8}\\.com$"},
            },
            "required": ["name", "email"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": WORD, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 4,
        },
        "note": WORD,
    },
    "required": ["id", "user", "items", "note"],
    "additionalProperties": False,
}


def nested(depth: int) -> dict:
    schema: dict = {"type": "string", "maxLength": 5}
    for _ in range(depth):
        schema = {"type": "object", "properties": {f"p{j}": schema for j in range(3)}, "required": ["p0"]}
    return schema


SPECS = {
    "regex (email)": StructuredOutputs(regex=r"[a-z]{1,12}@[a-z]{1,8}\.(com|org)"),
    "choice (3)": StructuredOutputs(choice=["yes", "no", "maybe"]),
    "Lark (arithmetic)": StructuredOutputs(grammar='start: e\ne: NUM | "(" e ("+"|"*") e ")"\nNUM: /[0-9]+/'),
    "json_object": StructuredOutputs(json_object=True),
    "JSON schema (order)": StructuredOutputs(json=SCHEMA),
    "JSON schema (3^4 nested)": StructuredOutputs(json=nested(4)),
    "JSON schema (3^6 nested)": StructuredOutputs(json=nested(6)),
}


def compile_times(engine: LLMEngine) -> dict:
    args = (engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids, 8, 60.0)
    t = time.perf_counter()
    GrammarCompiler(*args)
    out = {"grammar tokenizer": 1000 * (time.perf_counter() - t)}
    for name, spec in SPECS.items():
        compiler = GrammarCompiler(*args)
        t = time.perf_counter()
        compiler.matcher(spec)
        out[name] = 1000 * (time.perf_counter() - t)
    return out


def mask_times(engine: LLMEngine, rows: tuple[int, ...], steps: int = 50) -> dict:
    """Microseconds per matcher per mask, R matchers at once, walking SCHEMA's first tokens."""
    compiler = engine.grammars
    prefix = engine.tokenizer.encode('{"id":12,"user":{"name":"', add_special_tokens=False).ids
    out = {}
    for r in rows:
        matchers = [compiler.matcher(StructuredOutputs(json=SCHEMA)) for _ in range(r)]
        for m in matchers:
            assert m.consume_tokens(prefix)
        compiler.fill_masks(matchers)
        t = time.perf_counter()
        for _ in range(steps):
            compiler.fill_masks(matchers)
        out[r] = 1e6 * (time.perf_counter() - t) / steps / r
    return out


def run(engine: LLMEngine, prompts: list[list[int]], new: int, constrained: bool) -> tuple[float, float]:
    """(output tokens/s, mask microseconds per constrained token) of one round."""
    plain = SamplingParams(temperature=1.0, max_tokens=new, ignore_eos=True, seed=0)
    half = SamplingParams(
        temperature=1.0, max_tokens=new, seed=0, structured_outputs=StructuredOutputs(json=SCHEMA)
    )
    params = [half if constrained and i % 2 == 0 else plain for i in range(len(prompts))]
    m = engine.metrics
    s0, n0 = m.mask_seconds._value.get(), m.masked_tokens._value.get()
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    tokens = sum(len(o.token_ids) for o in outs)
    seconds, masked = m.mask_seconds._value.get() - s0, m.masked_tokens._value.get() - n0
    return tokens / (time.perf_counter() - t), (1e6 * seconds / masked if masked else 0.0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 requests, 48 new tokens, 2 rounds")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--rounds", type=int, default=5, help="alternating rounds, medians (default: %(default)s)"
    )
    ap.add_argument("--out", type=Path, help="JSON path (default results/structured-<device>[-quick].json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    n, new, rounds = (16, 48, 2) if args.quick else (32, 96, args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        engine = LLMEngine.from_pretrained(build_random_model(Path(tmp), 256), device=args.device)
    compiles = compile_times(engine)
    print("compile, ms (cold, one spec each)")
    for name, ms in compiles.items():
        print(f"  {name:28s} {ms:9.2f}")
    masks = mask_times(engine, (1, 8, 32))
    print("mask, us per matcher (R matchers at once, inside SCHEMA)")
    for r, us in masks.items():
        print(f"  R={r:<3d} {us:9.1f}")
    rng = random.Random(0)
    V = engine.model_config.vocab_size
    prompts = [[rng.randrange(3, V) for _ in range(64)] for _ in range(n)]
    run(engine, prompts[:2], 8, True)  # warm-up
    load_before = os.getloadavg()[0]
    plain, half, per_token = [], [], []
    for _ in range(rounds):
        plain.append(run(engine, prompts, new, False)[0])
        tok_s, us = run(engine, prompts, new, True)
        half.append(tok_s)
        per_token.append(us)
    p, h = statistics.median(plain), statistics.median(half)
    print(f"\n{n} requests x {new} new tokens, medians of {rounds} rounds")
    print("| | plain | half constrained (nested JSON schema) | ratio |")
    print("|---|---|---|---|")
    print(f"| output tokens/s | {p:.0f} | {h:.0f} | {h / p:.2f} (target >= {TARGET}) |")
    print(f"| mask us per constrained token | | {statistics.median(per_token):.1f} | |")
    result = {
        "device": args.device,
        "cpu": platform.processor() or platform.machine(),
        "threads": args.threads,
        "requests": n,
        "new_tokens": new,
        "rounds": rounds,
        "compile_ms": compiles,
        "mask_us_per_matcher": masks,
        "plain_tok_s": plain,
        "half_constrained_tok_s": half,
        "mask_us_per_constrained_token": per_token,
        "ratio": h / p,
        "target": TARGET,
        "load_average_before_after": [load_before, os.getloadavg()[0]],
    }
    name = f"structured-{args.device}{'-quick' if args.quick else ''}.json"
    write_results(result, args.out or RESULTS / name)
    return result


if __name__ == "__main__":
    main()
