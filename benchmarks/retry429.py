"""What fast-retrying clients cost the clients being served: the same closed-loop clients,
more than the server admits, first polite (after a 429 they wait `Retry-After`), then
impatient (they retry 50 ms after a 429), against the real gunicorn server on 127.0.0.1.
The served throughput (completion tokens/s of the 200s) of the impatient run over the
polite run's is the figure; the target is at least 0.8.

    python benchmarks/retry429.py [--clients 24] [--duration 40] [--rounds 2]
                                  [--max-num-seqs 4] [--max-queued 4] [--max-tokens 32]

The server admits `--max-num-seqs` running plus `--max-queued` waiting requests, so with
the default 24 clients about 16 are being refused at any moment (about 320 refusals a
second when impatient). Each client keeps its connection alive, as HTTP clients do. The
modes alternate in `--rounds` rounds, so background load on a shared machine hits both
alike. Model: `--model-dir`, else random weights of the training default size. Writes
benchmarks/results/retry429-<device>.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import RESULTS, Tally, build_random_model, prompts, run_clients, start_server  # noqa: E402

IMPATIENT_RETRY_S = 0.05
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def client(url: str, max_tokens: int, texts: list[str], polite: bool, refused: list[int]):
    """One request per call on a kept-alive connection; a 429 is retried, after Retry-After
    (polite) or after 50 ms (impatient), until it is served."""
    target = urlparse(url)
    local = threading.local()  # each client thread's connection

    def one_request(tally: Tally, rng: random.Random) -> None:
        body = json.dumps(
            {"prompt": rng.choice(texts), "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        )
        while True:
            if getattr(local, "conn", None) is None:
                local.conn = http.client.HTTPConnection(target.hostname, target.port, timeout=120)
            conn = local.conn
            sent = time.monotonic()
            try:
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                data = response.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                local.conn = None
                raise
            if response.status == 200:
                tokens = json.loads(data)["usage"]["completion_tokens"]
                tally.add(sent, [time.monotonic()], tokens)
                return
            if response.status != 429:
                raise RuntimeError(f"HTTP {response.status}: {data[:200]!r}")
            refused.append(1)
            time.sleep(float(response.headers["Retry-After"]) if polite else IMPATIENT_RETRY_S)

    return one_request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--duration", type=float, default=40.0, help="seconds per mode, over all rounds")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--max-queued", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory(prefix="lmops-retry-model-")
    model_dir = args.model_dir or build_random_model(Path(tmp.name))
    texts = prompts()
    load_before = os.getloadavg()
    proc, url = start_server(
        model_dir,
        args.device,
        LMOPS_MAX_NUM_SEQS=str(args.max_num_seqs),
        LMOPS_MAX_QUEUED=str(args.max_queued),
    )
    modes = {"polite": True, "impatient": False}
    tallies = {mode: Tally() for mode in modes}
    refused = {mode: [] for mode in modes}
    elapsed, server_cpu, client_cpu = (dict.fromkeys(modes, 0.0) for _ in range(3))
    [worker] = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    try:
        run_clients(Tally(), 4, 2, client(url, args.max_tokens, texts, True, []))  # warm-up
        for _ in range(args.rounds):
            for mode, polite in modes.items():
                one = client(url, args.max_tokens, texts, polite, refused[mode])
                server, mine = cpu_seconds(int(worker)), time.process_time()
                elapsed[mode] += run_clients(tallies[mode], args.clients, args.duration / args.rounds, one)
                server_cpu[mode] += cpu_seconds(int(worker)) - server
                client_cpu[mode] += time.process_time() - mine
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)

    summary = {
        mode: {
            "served_requests": tallies[mode].requests,
            "refused_429": len(refused[mode]),
            "refused_per_s": round(len(refused[mode]) / elapsed[mode], 1),
            "errors": len(tallies[mode].errors),
            "served_tokens_per_s": round(tallies[mode].tokens / elapsed[mode], 1),
            # on a 2-core box the load generator's own CPU competes with the server's
            "server_cpu_s_per_s": round(server_cpu[mode] / elapsed[mode], 2),
            "client_cpu_s_per_s": round(client_cpu[mode] / elapsed[mode], 2),
        }
        for mode in modes
    }
    ratio = summary["impatient"]["served_tokens_per_s"] / summary["polite"]["served_tokens_per_s"]
    result = {
        "workload": {
            "clients": args.clients,
            "duration_s_per_mode": args.duration,
            "rounds": args.rounds,
            "max_num_seqs": args.max_num_seqs,
            "max_queued": args.max_queued,
            "max_tokens": args.max_tokens,
            "impatient_retry_s": IMPATIENT_RETRY_S,
            "model": str(args.model_dir or "random weights, training default size"),
        },
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "device": args.device,
            "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        },
        **summary,
        "impatient_over_polite_served_tokens_per_s": round(ratio, 3),
        "target_ge_0.8": ratio >= 0.8,
    }
    print(json.dumps(result, indent=2))
    out = args.output or RESULTS / f"retry429-{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
