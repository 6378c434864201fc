"""Per-request timings and the engine's Prometheus metrics (names follow vLLM's, prefix `lmops:`).

Each engine owns its own `CollectorRegistry`, so several engines (tests, benchmarks)
can live in one process and the service exposes exactly one engine's numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from lmops.runtime.engine.scheduler import ScheduledBatch

# vLLM's bucket boundaries, so dashboards built for vLLM read these unchanged.
# fmt: off
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0, 2560.0,
)
_TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)
_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)
# fmt: on

# Prompt bits per byte: ~12% apart from 0.5 to 16, so a median read by histogram_quantile
# (linear within a bucket) is good to a few percent anywhere a model's reference may lie.
BPB_BUCKETS = tuple(round(0.5 * 1.125**k, 3) for k in range(30))


# Per-priority series: the first this many distinct request priorities get a label of their
# own, later ones share "other", so no client can grow /metrics with new priorities.
MAX_PRIORITY_LABELS = 16


def now() -> float:
    """The one clock all request timings use (monotonic: immune to wall-clock jumps)."""
    return time.monotonic()


@dataclass
class RequestMetrics:
    """Timestamps (engine clock, seconds) and counts of one request; derived latencies as properties."""

    arrival_time: float
    num_prompt_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_bits_per_byte: float | None = None  # scored for a sampled fraction (drift_sample)

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (the decode speed a user sees)."""
        if self.first_token_time is None or self.last_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)


class EngineMetrics:
    """The Prometheus view of one engine; the engine calls the `on_*` hooks from its step."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.ttft = Histogram(
            "lmops:time_to_first_token_seconds", "Time to first token.", buckets=_TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "lmops:time_per_output_token_seconds",
            "Time between consecutive output tokens of a request.",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "lmops:e2e_request_latency_seconds",
            "End-to-end request latency.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "lmops:request_queue_time_seconds",
            "Time from arrival to first scheduling.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_by_priority = Histogram(
            "lmops:request_queue_time_by_priority_seconds",
            "Time from arrival to first scheduling, by request priority (lower runs first).",
            ["priority"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.waiting_by_priority = Gauge(
            "lmops:num_requests_waiting_by_priority",
            "Requests waiting to be scheduled, by request priority.",
            ["priority"],
            registry=r,
        )
        self._priority_labels: set[str] = set()
        self.running = Gauge("lmops:num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("lmops:num_requests_waiting", "Requests waiting to be scheduled.", registry=r)
        self.kv_usage = Gauge(
            "lmops:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", registry=r
        )
        self.prefix_queries = Counter(
            "lmops:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        self.prefix_hits = Counter(
            "lmops:prefix_cache_hits", "Prompt tokens found in the prefix cache.", registry=r
        )
        self.preemptions = Counter(
            "lmops:num_preemptions", "Sequences preempted (to be recomputed).", registry=r
        )
        self.prompt_tokens = Counter("lmops:prompt_tokens", "Prefill tokens processed.", registry=r)
        self.generation_tokens = Counter("lmops:generation_tokens", "Tokens generated.", registry=r)
        self.success = Counter(
            "lmops:request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        self.steps = Counter(
            "lmops:engine_steps",
            "Engine steps run (flat while requests wait: the loop is stuck).",
            registry=r,
        )
        self.prompt_bpb = Histogram(
            "lmops:prompt_bits_per_byte",
            "Model cross-entropy of sampled prompts in bits per byte (the drift signal).",
            buckets=BPB_BUCKETS,
            registry=r,
        )
        self.structured_requests = Counter(
            "lmops:structured_output_requests",
            "Requests whose output follows a grammar, by kind (json, json_object, regex, choice, grammar).",
            ["kind"],
            registry=r,
        )
        self.masked_tokens = Counter(
            "lmops:structured_output_tokens", "Tokens drawn under a grammar's mask.", registry=r
        )
        self.mask_seconds = Counter(
            "lmops:structured_output_mask_seconds",
            "Time spent computing grammar masks (per token: divide by lmops:structured_output_tokens).",
            registry=r,
        )
        # vLLM's speculative-decoding counters: acceptance rate = accepted / draft tokens.
        self.spec_draft_tokens = Counter(
            "lmops:spec_decode_num_draft_tokens", "Draft tokens proposed (speculative decoding).", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "lmops:spec_decode_num_accepted_tokens",
            "Draft tokens accepted (speculative decoding).",
            registry=r,
        )
        self.reference_bpb: Gauge | None = None  # created only when the model has a reference
        # vLLM's cache_config_info: the cache's shape as labels (value 1), which the
        # Inference Gateway's prefix-cache producer reads to size its blocks and index.
        self.cache_config = Gauge(
            "lmops:cache_config_info",
            "KV cache configuration (labels; value 1).",
            ["block_size", "num_gpu_blocks", "enable_prefix_caching"],
            registry=r,
        )

    def set_cache_config(self, *, block_size: int, num_blocks: int, prefix_caching: bool) -> None:
        self.cache_config.labels(
            block_size=str(block_size),
            num_gpu_blocks=str(num_blocks),
            enable_prefix_caching=str(prefix_caching),
        ).set(1)

    def set_reference_bits_per_byte(self, value: float) -> None:
        """The served model's test bits/byte from promotion: what `prompt_bits_per_byte` compares to."""
        if self.reference_bpb is None:
            self.reference_bpb = Gauge(
                "lmops:model_reference_bits_per_byte",
                "The served model's test-split bits per byte, recorded at promotion.",
                registry=self.registry,
            )
        self.reference_bpb.set(value)

    def on_prompt_scored(self, m: RequestMetrics, bits_per_byte: float) -> None:
        m.prompt_bits_per_byte = bits_per_byte
        self.prompt_bpb.observe(bits_per_byte)

    def on_schedule(self, batch: ScheduledBatch, t: float) -> None:
        """A step's schedule: requests scheduled for the first time (queue time, cached and
        prompt tokens), preemptions, prefix-cache lookups."""
        self.steps.inc()
        prompt_tokens = 0
        for seq in batch.admitted:
            m = seq.request.metrics
            if m.first_scheduled_time is None:
                self.on_first_scheduled(m, t, seq.request.priority)
                m.num_cached_tokens = seq.num_computed_tokens
                prompt_tokens += m.num_prompt_tokens
        if batch.preempted:
            self.preemptions.inc(len(batch.preempted))
        if batch.prefix_queries:
            self.prefix_queries.inc(batch.prefix_queries)
            self.prefix_hits.inc(batch.prefix_hits)
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)

    def on_tokens(self, m: RequestMetrics, t: float, count: int) -> None:
        """`count` tokens of one request (one per completion) generated in the step ending at `t`:
        TTFT on the first, else one inter-token latency observation."""
        if m.first_token_time is None:
            m.first_token_time = t
            self.ttft.observe(t - m.arrival_time)
        else:
            self.tpot.observe(t - m.last_token_time)
        m.last_token_time = t
        m.num_generation_tokens += count
        self.generation_tokens.inc(count)

    def on_structured_request(self, kind: str) -> None:
        self.structured_requests.labels(kind=kind).inc()

    def on_token_masks(self, count: int, seconds: float) -> None:
        self.masked_tokens.inc(count)
        self.mask_seconds.inc(seconds)

    def on_speculation(self, drafted: int, accepted: int) -> None:
        self.spec_draft_tokens.inc(drafted)
        self.spec_accepted_tokens.inc(accepted)

    def on_first_scheduled(self, m: RequestMetrics, t: float, priority: int = 0) -> None:
        m.first_scheduled_time = t
        self.queue.observe(t - m.arrival_time)
        self.queue_by_priority.labels(self._priority_label(priority)).observe(t - m.arrival_time)

    def _priority_label(self, priority: int) -> str:
        label = str(priority)
        if label not in self._priority_labels:
            if len(self._priority_labels) >= MAX_PRIORITY_LABELS:
                return "other"
            self._priority_labels.add(label)
        return label

    def on_finished(self, m: RequestMetrics, reason: str, t: float) -> None:
        m.finished_time = t
        self.e2e.observe(t - m.arrival_time)
        self.success.labels(finished_reason=reason).inc()

    def set_state(self, *, running: int, waiting: dict[int, int], kv_usage: float) -> None:
        """`waiting`: requests waiting, by priority."""
        self.running.set(running)
        self.waiting.set(sum(waiting.values()))
        self.kv_usage.set(kv_usage)
        counts = dict.fromkeys(self._priority_labels, 0)
        for priority, count in waiting.items():
            label = self._priority_label(priority)
            counts[label] = counts.get(label, 0) + count
        for label, count in counts.items():
            self.waiting_by_priority.labels(label).set(count)
