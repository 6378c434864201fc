"""Serving latency of a candidate against the champion, measured side by side in one run.

Both models are served by the engine on one fixed workload, alternating round by round
(ABBA), so whatever else loads a shared machine slows both alike and their ratio stays
meaningful where absolute numbers would not be (a CI runner, a busy laptop).

The workload is text, not token ids: two models with different tokenizers then serve the
same request. A round is one batch of `len(PROMPTS)` concurrent requests, what a lightly
loaded service sees: TTFT covers a batched prefill, inter-token latency a batched decode
step. Greedy with `ignore_eos`, so each request generates `MAX_TOKENS` whatever the
weights; 32 tokens give 31 inter-token gaps per request, enough for a p95, and keep a
round of the default model (params.yaml's shape, vocab 4096) near 0.2 s of one core.

Torch runs on one intra-op thread while measuring: on a shared machine a second thread
waits at every op's barrier for a core another process holds, which turned 0.03 s rounds
into 0.5-3 s ones at random on a loaded 2-core machine. The ratio is what is gated, and
one thread measures it steadily; the absolute numbers are single-core ones.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from lmops.runtime.engine import LLMEngine, SamplingParams

# Code and prose, like the training data and what the service is asked.
PROMPTS = (
    "def merge_sorted(a, b):\n    result = []\n    i = j = 0\n",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n",
    "The quick brown fox jumps over the lazy dog, and then",
    "# Read the file line by line and count the words in each line.\n",
)
MAX_TOKENS = 32
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompts(engine: LLMEngine, tag: str) -> list[list[int]]:
    """The workload's token ids for `engine`. Each round's prompts start with their own
    tag, so no round is served from the prefix cache of an earlier one (TTFT stays a real
    prefill); a prompt keeps at most half the context, so a short-context model still
    has room for MAX_TOKENS (or half its context)."""
    keep = engine.max_model_len // 2
    return [
        engine.tokenizer.encode(f"# {tag}.{i}\n{text}", add_special_tokens=False).ids[:keep]
        for i, text in enumerate(PROMPTS)
    ]


@dataclass
class _Samples:
    """One model's measurements, over its rounds."""

    # Seconds from each request's arrival to its first token.
    ttfts: list[float] = field(default_factory=list)
    # Seconds between consecutive tokens of a request.
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0  # generated, over all rounds
    seconds: float = 0.0  # wall time of all rounds

    def stats(self) -> dict[str, float]:
        return {
            "ttft_p50": float(np.percentile(self.ttfts, 50)),
            "ttft_p95": float(np.percentile(self.ttfts, 95)),
            "itl_p50": float(np.percentile(self.gaps, 50)),
            "itl_p95": float(np.percentile(self.gaps, 95)),
            "tokens_per_s": self.tokens / self.seconds,
        }


def _round(engine: LLMEngine, tag: str, samples: _Samples) -> None:
    """Serve the workload once, adding what it measured to `samples`.

    TTFT is the engine's own (RequestMetrics: arrival to first token); the gaps between a
    request's consecutive tokens are timed here after each step, as RequestMetrics keeps
    only the first and last token's times."""
    start = time.perf_counter()
    for i, ids in enumerate(_prompts(engine, tag)):
        engine.add_request(f"latency-{tag}-{i}", ids, PARAMS)
    last: dict[str, float] = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        t = time.perf_counter()
        for out in outputs:
            if out.request_id in last:
                samples.gaps.append(t - last[out.request_id])
            last[out.request_id] = t
            if out.finished:
                samples.ttfts.append(out.metrics.ttft)
                samples.tokens += out.metrics.num_generation_tokens
    samples.seconds += time.perf_counter() - start


def compare(candidate: LLMEngine, champion: LLMEngine, rounds: int = 3) -> dict:
    """Both engines on the workload: one warm-up round each (first-call costs: allocator,
    kernels, a compiled graph's guards), then `rounds` rounds each, alternating.

    Returns {"candidate": stats, "champion": stats, "ratios": {...}, "ratio": float,
    "rounds": rounds}; stats are ttft_p50/p95 and itl_p50/p95 (seconds) and tokens_per_s
    (over the wall time of that model's rounds). Each of `ratios` is candidate over
    champion, >1 meaning the candidate is slower (tokens/s inverted to match).

    `ratio`, what the gate compares, is the tokens/s one: the candidate's wall time for
    the champion's work, prefill and decode weighted as the workload has them. It sums
    some hundred steps, so a step another process preempts moves it by a fraction, whereas
    the TTFT p50 rests on one prefill step per round: comparing a model with itself on a
    2-core machine at load 5-8, the TTFT ratio ranged 0.36-2.9 while this one stayed in
    0.8-1.15. The TTFT and inter-token ratios are recorded to say where a slowdown lies."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see the module's docstring
    try:
        return _compare(candidate, champion, rounds)
    finally:
        torch.set_num_threads(threads)


def _compare(candidate: LLMEngine, champion: LLMEngine, rounds: int) -> dict:
    engines, samples = (candidate, champion), (_Samples(), _Samples())
    for engine in engines:
        _round(engine, "warmup", _Samples())
    for r in range(rounds):
        for k in (0, 1) if r % 2 == 0 else (1, 0):  # ABBA: neither always runs first
            # k in the tag: even one engine passed twice never hits its own prefix cache.
            _round(engines[k], f"round-{r}-{k}", samples[k])
    cand, champ = (s.stats() for s in samples)
    ratios = {key: cand[key] / champ[key] for key in ("ttft_p50", "ttft_p95", "itl_p50", "itl_p95")}
    ratios["tokens_per_s"] = champ["tokens_per_s"] / cand["tokens_per_s"]
    return {
        "candidate": cand,
        "champion": champ,
        "ratios": ratios,
        "ratio": ratios["tokens_per_s"],
        "rounds": rounds,
    }


def check_ratio(result: dict, max_ratio: float | None) -> tuple[bool, str]:
    """(passes, why): the candidate may be at most `max_ratio` times slower than the champion;
    None records the numbers and never refuses."""
    r = result["ratios"]
    numbers = (
        f"latency ratio {result['ratio']:.2f} ({result['candidate']['tokens_per_s']:.0f} vs the "
        f"champion's {result['champion']['tokens_per_s']:.0f} tokens/s; TTFT p50 x{r['ttft_p50']:.2f}, "
        f"inter-token p50 x{r['itl_p50']:.2f})"
    )
    if max_ratio is None:
        return True, f"{numbers}; no max_latency_ratio set"
    if not math.isfinite(result["ratio"]) or result["ratio"] > max_ratio:
        return False, f"{numbers} exceeds max_latency_ratio {max_ratio:g}"
    return True, f"{numbers} within max_latency_ratio {max_ratio:g}"
