"""What the service records per request: `RequestStats`, filled as a request runs,
becomes one JSON access-log line and the HTTP counts and latencies on /metrics,
both written when the response is closed (for a stream: after its last event, or
when the client went away). `ModelMetrics`: which versions serve, their swaps, and
the shadow comparison."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lmops.runtime.engine.metrics import BPB_BUCKETS
from production_service.model_source import CHALLENGER, CHAMPION

access_log = logging.getLogger("lmops.access")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Every label takes its value from a fixed set, so no client can grow /metrics:
# handlers are route rules (or "unmatched"), statuses are the app's own.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


@dataclass
class RequestStats:
    """What the access log and the HTTP metrics need from a request, filled as it runs."""

    request_id: str
    start: float = field(default_factory=time.perf_counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float | None = None
    error: str | None = None
    disconnected: bool = False

    def on_tokens(self, count: int) -> None:
        if count and self.ttft is None:
            self.ttft = time.perf_counter() - self.start
        self.completion_tokens += count


def configure_logging() -> None:
    """Plain lines for the service's logs; bare JSON lines for the access log."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(
            level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    if not access_log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        access_log.addHandler(handler)
        access_log.setLevel(logging.INFO)
        access_log.propagate = False


class HttpMetrics:
    def __init__(self, ready: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # Read at scrape time: with the replica count, what "no ready replica" alerts on.
        Gauge(
            "lmops:service_ready",
            "1 when this replica serves (model loaded, not draining).",
            registry=self.registry,
        ).set_function(lambda: float(ready()))
        self.requests = Counter(
            "http_requests",
            "HTTP requests by handler and status.",
            ["method", "handler", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "http_request_duration_seconds",
            "HTTP request latency, to the last byte of the response.",
            ["method", "handler"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def count(self, method: str, handler: str, status: int, seconds: float) -> None:
        label = method if method in METHODS else "other"
        self.requests.labels(label, handler, str(status)).inc()
        self.latency.labels(label, handler).observe(seconds)

    def finish(self, stats: RequestStats, method: str, path: str, handler: str, status: int) -> None:
        total = time.perf_counter() - stats.start
        self.count(method, handler, status, total)
        record = {
            "request_id": stats.request_id,
            "method": method[:16],
            "path": path[:200],
            "status": status,
            "prompt_tokens": stats.prompt_tokens,
            "completion_tokens": stats.completion_tokens,
            "ttft_s": None if stats.ttft is None else round(stats.ttft, 4),
            "total_s": round(total, 4),
        }
        if stats.error:
            record["error"] = stats.error
        if stats.disconnected:
            record["client_disconnected"] = True
        access_log.info(json.dumps(record))


class ModelMetrics:
    """The models behind the replica, by role (champion, challenger): on /metrics beside
    the champion engine's own, whose registry a swap replaces."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.info = Gauge(
            "lmops:model_info",
            "The model serving each role (labels; value 1).",
            ["role", "model", "version"],
            registry=r,
        )
        self.swaps = Counter(
            "lmops:model_swaps", "New versions swapped in without a restart.", ["role"], registry=r
        )
        self.refused = Counter(
            "lmops:model_swaps_refused",
            "New versions refused (failed verification, loading or warm-up); the old one kept serving.",
            ["role"],
            registry=r,
        )
        self.poll_errors = Counter(
            "lmops:model_poll_errors", "Failed looks for a new version (registry down).", ["role"], registry=r
        )
        self.shadow_bpb = Histogram(
            "lmops:shadow_prompt_bits_per_byte",
            "Bits per byte of the prompts mirrored to the challenger, scored by both models "
            "(each with its own tokenizer), by role and the challenger that scored them.",
            ["role", "challenger_model", "challenger_version"],
            buckets=BPB_BUCKETS,
            registry=r,
        )
        self.shadow_dropped = Counter(
            "lmops:shadow_prompts_dropped",
            "Prompts picked for mirroring that the challenger did not score (its queue full, too long).",
            registry=r,
        )
        self._labels: dict[str, tuple[str, str, str]] = {}

    def serving(self, role: str, model: str, version: str | None) -> None:
        """`role` is now served by `model` at `version`; its previous series goes."""
        if role in self._labels:
            self.info.remove(*self._labels[role])
        self._labels[role] = (role, model, version or "none")
        self.info.labels(*self._labels[role]).set(1)
        if role == CHALLENGER:  # its shadow series at 0 from the start (all 0 without shadow mode)
            for each in (CHAMPION, CHALLENGER):
                self.shadow_bpb.labels(each, model, version or "none")
        for counter in (self.swaps, self.refused, self.poll_errors):
            counter.labels(role)  # at 0 from the start, so the first increase is seen
