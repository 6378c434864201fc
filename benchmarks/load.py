"""Load benchmark of the service: C concurrent streaming clients against the real
gunicorn server on 127.0.0.1 for T seconds, on /v1/completions and on
/v1/chat/completions, then the same workload straight through the engine
in-process, so the HTTP overhead (and chat's over completions') reads as a ratio.

    python benchmarks/load.py [--clients 32] [--duration 30] [--max-tokens 64]
                              [--model-dir DIR] [--url http://127.0.0.1:5001 --api-key KEY]

Without --url it starts gunicorn itself with the production config
(production_service/gunicorn.conf.py) on a free port, and stops it before the
in-process run so the two never share the CPU. Without --model-dir it serves
production_service/model, or when that is missing a randomly initialised model of
the training default size (vocab 4096, 4 layers, 192 wide, context 256).

Each client loops until T is up: one streaming completion (a Shakespeare slice of
~48 tokens, `max_tokens` new ones, EOS ignored so every request generates exactly
that many), measuring TTFT (request sent -> first token) and inter-token latency.
The chat phase sends the same slice as one user message (the model's chat template
adds its few tokens) and reads `chat.completion.chunk` events the same way.
Output tokens/s = tokens generated / wall time until the last request finished.
Prints a table; writes benchmarks/results/load-<device>.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


@dataclass
class Tally:
    """Per-phase measurements, appended to from every client thread."""

    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    # (sent, first token, the X-Model-Version that answered) per request with a token
    answers: list[tuple[float, float, str | None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, sent: float, token_times: list[float], tokens: int, version: str | None = None) -> None:
        with self.lock:
            self.requests += 1
            self.tokens += tokens
            if token_times:
                self.ttft.append(token_times[0] - sent)
                self.itl.extend(b - a for a, b in zip(token_times, token_times[1:], strict=False))
                self.answers.append((sent, token_times[0], version))

    def error(self, what: str) -> None:
        with self.lock:
            self.errors.append(what)


def prompts(count: int = 64, chars: int = 200) -> list[str]:
    rng = random.Random(0)
    text = SHAKESPEARE.read_text() if SHAKESPEARE.is_file() else "To be, or not to be. " * 5000
    starts = [rng.randrange(0, len(text) - chars) for _ in range(count)]
    return [text[s : s + chars] for s in starts]


def run_clients(tally: Tally, clients: int, duration: float, one_request) -> float:
    """`clients` threads, each calling one_request(tally, rng) until `duration` is up;
    their starts are spread over a second, as real arrivals are (a synchronized
    burst of C prompts would only measure that burst's TTFT). Returns the wall time."""
    deadline = time.monotonic() + duration

    def client(i: int) -> None:
        rng = random.Random(i)
        time.sleep(i / clients)
        while time.monotonic() < deadline:
            try:
                one_request(tally, rng)
            except Exception as exc:  # every failure counts as an error, none stops the run
                tally.error(f"{type(exc).__name__}: {exc}")

    start = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - start


def http_client(url: str, api_key: str | None, max_tokens: int, texts: list[str], chat: bool = False):
    """one_request for run_clients: a streaming completion (or chat completion) over a
    keep-alive connection."""
    target = urlparse(url)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    local = threading.local()

    def one_request(tally: Tally, rng: random.Random) -> None:
        if getattr(local, "conn", None) is None:
            local.conn = http.client.HTTPConnection(target.hostname, target.port, timeout=120)
        text = rng.choice(texts)
        body = json.dumps(
            {
                **({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}),
                "max_tokens": max_tokens,
                "stream": True,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            }
        )
        sent = time.monotonic()
        try:
            local.conn.request("POST", path, body, headers)
            response = local.conn.getresponse()
        except (OSError, http.client.HTTPException):
            local.conn = None
            raise
        if response.status != 200:
            tally.error(f"HTTP {response.status}: {response.read()[:200]!r}")
            return
        token_times, last, done = [], b"", False
        while line := response.readline():
            if line.startswith(b"data: [DONE]"):
                done = True
            elif line.startswith(b"data: {"):
                last = line
                if json.loads(line[6:])["choices"]:  # the usage chunk carries no token
                    token_times.append(time.monotonic())
        if not done:
            local.conn = None
            tally.error("stream ended without [DONE]")
            return
        tokens = json.loads(last[6:])["usage"]["completion_tokens"]
        tally.add(sent, token_times, tokens, response.getheader("X-Model-Version"))

    return one_request


def engine_client(loop, max_tokens: int, texts: list[str]):
    """one_request for run_clients: the same request straight into the engine loop."""
    from lmops.runtime.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    def one_request(tally: Tally, rng: random.Random) -> None:
        sent = time.monotonic()
        token_times, final = [], None
        for out in loop.submit(rng.choice(texts), params):
            if out.outputs[0].delta_token_ids:
                token_times.append(time.monotonic())
            final = out
        tally.add(sent, token_times, len(final.outputs[0].token_ids))

    return one_request


def start_engine(model_dir: Path, device: str):
    """An engine with the server's own settings (ServiceConfig defaults), looping."""
    from lmops.runtime.engine import EngineLoop, LLMEngine, SamplingParams
    from production_service.settings import ServiceConfig

    config = ServiceConfig(device=device)
    engine = LLMEngine.from_pretrained(model_dir, config.engine)
    engine.generate(["warm up"], SamplingParams(max_tokens=8))
    return EngineLoop(engine, max_queued=config.max_queued).start()


def start_server(model_dir: Path, device: str, **settings: str) -> tuple[subprocess.Popen, str]:
    """The real server on free 127.0.0.1 ports; `settings` are extra environment variables."""
    from production_service.server import gunicorn_argv, serving_env, wait_ready

    ports = []
    for _ in range(2):  # the API port and the probe port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    env = {
        **os.environ,
        "HOST": "127.0.0.1",
        "PORT": str(ports[0]),
        "LMOPS_PROBE_PORT": str(ports[1]),
        "LMOPS_MODEL_DIR": str(model_dir),
        "LMOPS_DEVICE": device,
        **settings,
    }
    env.pop("LMOPS_API_KEY", None)
    with tempfile.NamedTemporaryFile(prefix="lmops-load-", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(
            gunicorn_argv(), cwd=REPO, env=serving_env(env), stdout=log, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{ports[0]}"
    if not wait_ready(url, proc, timeout=300):  # a first decode compile on a busy box is slow
        proc.kill()
        raise SystemExit(f"server did not become ready; see {log.name}")
    print(f"server ready at {url} (log {log.name})", file=sys.stderr)
    return proc, url


def build_random_model(directory: Path, seed: int = 0) -> Path:
    """The training default size with random weights (the benchmark measures speed, not text)."""
    from lmops.pipeline.random_model import random_model_dir

    text = SHAKESPEARE.read_text() if SHAKESPEARE.is_file() else "To be, or not to be. " * 5000
    texts = [text[i : i + 65536] for i in range(0, len(text), 65536)]
    return random_model_dir(
        directory, texts, 4096, 256, seed=seed, meta={"model_name": "random-default-size"}
    )


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def summary(tally: Tally, elapsed: float) -> dict:
    """Totals over every round of one mode."""
    return {
        "requests": tally.requests,
        "errors": len(tally.errors),
        "first_errors": tally.errors[:5],
        "output_tokens": tally.tokens,
        "elapsed_s": round(elapsed, 2),
        "output_tokens_per_s": round(tally.tokens / elapsed, 1),
        "ttft_p50_ms": ms(pct(tally.ttft, 50)),
        "ttft_p95_ms": ms(pct(tally.ttft, 95)),
        "itl_p50_ms": ms(pct(tally.itl, 50)),
        "itl_p95_ms": ms(pct(tally.itl, 95)),
    }


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds per phase (bounded)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two modes")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--api-key", default=os.environ.get("LMOPS_API_KEY"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory(prefix="lmops-load-model-")
    model_dir, model_label = args.model_dir, str(args.model_dir)
    if model_dir is None:
        promoted = REPO / "production_service" / "model"
        model_dir, model_label = promoted, "production_service/model"
        if not (promoted / "config.json").is_file():
            model_dir = build_random_model(Path(tmp.name))
            model_label = "random weights, training default size (vocab 4096, 4 x 192, context 256)"
    texts = prompts()
    load_before = os.getloadavg()

    proc, url = (None, args.url) if args.url else start_server(model_dir, args.device)
    loop = start_engine(model_dir, args.device)
    clients = {
        "http": http_client(url, args.api_key, args.max_tokens, texts),
        "chat": http_client(url, args.api_key, args.max_tokens, texts, chat=True),
        "in_process": engine_client(loop, args.max_tokens, texts),
    }
    tallies = {mode: Tally() for mode in clients}
    elapsed = dict.fromkeys(clients, 0.0)
    client_cpu = dict.fromkeys(clients, 0.0)
    try:
        for one_request in clients.values():  # warm-up
            run_clients(Tally(), 4, 2, one_request)
        # The modes alternate in short rounds, so background load on a shared machine
        # hits them alike; the server idles while the engine runs in-process.
        for _ in range(args.rounds):
            for mode, one_request in clients.items():
                cpu = time.process_time()
                elapsed[mode] += run_clients(
                    tallies[mode], args.clients, args.duration / args.rounds, one_request
                )
                client_cpu[mode] += time.process_time() - cpu
    finally:
        loop.shutdown(5)
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)

    modes = {mode: summary(tallies[mode], elapsed[mode]) for mode in clients}
    http_s, chat_s, eng_s = modes["http"], modes["chat"], modes["in_process"]
    ratio = http_s["output_tokens_per_s"] / eng_s["output_tokens_per_s"]
    chat_ratio = chat_s["output_tokens_per_s"] / http_s["output_tokens_per_s"]
    p95_over_p50 = http_s["ttft_p95_ms"] / http_s["ttft_p50_ms"] if http_s["ttft_p50_ms"] else None
    result = {
        "workload": {
            "clients": args.clients,
            "duration_s": args.duration,
            "rounds": args.rounds,
            "max_tokens": args.max_tokens,
            "prompt_chars": 200,
            "ignore_eos": True,
            "model": model_label,
        },
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "device": args.device,
            "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        },
        "http": {**http_s, "client_cpu_s": round(client_cpu["http"], 2)},
        "chat": {**chat_s, "client_cpu_s": round(client_cpu["chat"], 2)},
        "in_process": eng_s,
        "http_over_in_process_tokens_per_s": round(ratio, 3),
        "chat_over_completions_tokens_per_s": round(chat_ratio, 3),
        "http_ttft_p95_over_p50": None if p95_over_p50 is None else round(p95_over_p50, 2),
        "targets": {
            "zero_errors": http_s["errors"] == 0 and chat_s["errors"] == 0,
            "ratio_ge_0.85": ratio >= 0.85,
            "chat_ratio_ge_0.9": chat_ratio >= 0.9,
            "ttft_p95_within_3x_p50": p95_over_p50 is not None and p95_over_p50 <= 3,
        },
    }
    rows = [
        ("requests", "requests"),
        ("errors", "errors"),
        ("output tokens/s", "output_tokens_per_s"),
        ("TTFT p50 ms", "ttft_p50_ms"),
        ("TTFT p95 ms", "ttft_p95_ms"),
        ("ITL p50 ms", "itl_p50_ms"),
        ("ITL p95 ms", "itl_p95_ms"),
    ]
    print(f"\n{args.clients} streaming clients, {args.duration:.0f} s, {args.max_tokens} new tokens each")
    print(f"{'':18}{'completions':>12}{'chat':>12}{'in-process':>12}")
    for label, key in rows:
        print(f"{label:18}{http_s[key]!s:>12}{chat_s[key]!s:>12}{eng_s[key]!s:>12}")
    print(
        f"HTTP / in-process output tokens/s: {ratio:.3f}; chat / completions: {chat_ratio:.3f}; "
        f"HTTP TTFT p95/p50: {p95_over_p50}"
    )
    print(f"targets: {result['targets']}")
    output = args.output or RESULTS / f"load-{args.device}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
