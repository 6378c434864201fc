"""A live champion under load: what a promote costs the clients of a replica that follows
`models:/lmops@champion`, what 20 swaps leave behind, and what shadow mode costs.

    python benchmarks/swap.py [--clients 32] [--swaps 3] [--phase 12] [--memory-swaps 20]
                              [--shadow-rounds 3] [--max-tokens 64] [--poll-s 5] [--model-dir DIR]

The real server (gunicorn, production config, compiling its decode steps unless
LMOPS_COMPILE=0) follows the alias of a local SQLite MLflow registry
(lmops.pipeline.scratch_registry) holding two versions of the model (the same files:
each swap costs what a same-size promote does; the compile cache is warm after the
first load), looking every `--poll-s` s (LMOPS_MODEL_POLL_S, default the service's).
Three measurements, each against a baseline taken in the same run:

- swap: C streaming clients (load.py's) for `--phase` s without a swap (steady), then
  as long with the alias moved 3 s in, `--swaps` times. Swap latency = the alias moving
  -> the first token of the first answer from the new version (the poll's wait
  included); TTFT p99 of the requests sent from the move to 1 s after that first token,
  over the steady phases' p99.
- memory: `--memory-swaps` more swaps, 4 requests served after each; the worker's RSS
  once the old version is retired, the last against the first (every version is the
  same size, so the first is the steady level).
- shadow: a replica with a challenger (a second random model of the same size) and
  LMOPS_SHADOW_SHARE=0.1 against one without, each started afresh per round, the order
  alternating (`--shadow-rounds`); the champion's TTFT p95 with shadow over without.

Prints a table; writes benchmarks/results/swap-<device>.json (with the load average).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import cpu_description, write_results  # noqa: E402
from load import RESULTS, Tally, build_random_model, http_client, ms, pct, prompts, run_clients, start_server  # noqa: E402

from lmops.pipeline.scratch_registry import local_registry  # noqa: E402
from production_service.settings import ServiceConfig  # noqa: E402

SWAPS = "lmops:model_swaps_total"


def scrape(url: str, name: str, role: str | None = None) -> float:
    """The sum of the server's `name` samples (with `role`, only that role's; 0 when absent)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    labels = r"\{[^}]*\}" if role is None else rf'\{{(?:[^}}]*,)?role="{role}"[^}}]*\}}'
    pattern = rf"^{re.escape(name)}(?:{labels})? (\S+)$"
    return sum(float(value) for value in re.findall(pattern, text, re.M))


def worker_rss_mib(master_pid: int) -> float:
    [pid] = Path(f"/proc/{master_pid}/task/{master_pid}/children").read_text().split()
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) / 1024


class Follower:
    """The server following lmops@champion, and the alias moved between versions 1 and 2."""

    def __init__(self, registry, url: str):
        self.registry, self.url = registry, url
        self.serving, self.swaps = 1, scrape(url, SWAPS, "champion")

    def move(self) -> float:
        """Point the alias at the other version; when it moved."""
        self.serving = 3 - self.serving
        moved = time.monotonic()
        self.registry.move("champion", self.serving)
        return moved

    def wait_swapped(self, timeout: float = 300) -> None:
        """Until the server has counted the swap and the old version is retired (its
        in-flight requests done: a second or two)."""
        deadline = time.monotonic() + timeout
        while scrape(self.url, SWAPS, "champion") <= self.swaps:
            if time.monotonic() > deadline:
                raise SystemExit(f"no swap to version {self.serving} within {timeout} s")
            time.sleep(0.2)
        self.swaps += 1
        time.sleep(2)


def swap_phases(follower: Follower, args, one_request) -> dict:
    steady, latencies, during, errors = Tally(), [], [], []
    for _ in range(args.swaps):
        run_clients(steady, args.clients, args.phase, one_request)
        tally = Tally()
        clients = threading.Thread(target=run_clients, args=(tally, args.clients, args.phase, one_request))
        clients.start()
        time.sleep(3)
        moved, new = follower.move(), str(follower.serving)
        clients.join()
        follower.wait_swapped()
        firsts = sorted(first for _, first, version in tally.answers if version == new and first >= moved)
        if not firsts:
            raise SystemExit(f"no answer from version {new} within the phase: raise --phase")
        latencies.append(firsts[0] - moved)
        during += [first - sent for sent, first, _ in tally.answers if moved <= sent <= firsts[0] + 1]
        errors += tally.errors
    p99_steady, p99_swap = pct(steady.ttft, 99), pct(during, 99)
    return {
        "swap_latency_s": [round(s, 2) for s in latencies],
        "swap_latency_max_s": round(max(latencies), 2),
        "ttft_p99_steady_ms": ms(p99_steady),
        "ttft_p99_during_swap_ms": ms(p99_swap),
        "ttft_p99_swap_over_steady": round(p99_swap / p99_steady, 2),
        "requests_during_swaps": len(during),
        "errors": len(steady.errors) + len(errors),
        "first_errors": (steady.errors + errors)[:5],
    }


def memory_phase(follower: Follower, proc, args, one_request) -> dict:
    rss, tally, rng = [], Tally(), random.Random(0)
    for _ in range(args.memory_swaps):
        follower.move()
        follower.wait_swapped()
        for _ in range(4):
            one_request(tally, rng)
        rss.append(round(worker_rss_mib(proc.pid), 1))
    return {
        "swaps": args.memory_swaps,
        "rss_mib_after_each_swap": rss,
        "rss_first_mib": rss[0],
        "rss_last_mib": rss[-1],
        "rss_last_over_first": round(rss[-1] / rss[0], 3),
        "errors": len(tally.errors),
    }


def shadow_phase(model_dir: Path, challenger: Path, args, texts) -> dict:
    """Champion TTFT p95 with a challenger shadowing 10% of prompts, over a replica without.
    One replica at a time, started afresh for each round (two idle side by side measured
    apart by 2-4x, whichever started first being the slower), the order alternating."""
    settings = {"off": {}, "on": {"LMOPS_CHALLENGER_DIR": str(challenger), "LMOPS_SHADOW_SHARE": "0.1"}}
    tallies = {mode: Tally() for mode in settings}
    mirrored = dropped = 0.0
    sums = dict.fromkeys(("champion", "challenger"), 0.0)
    for r in range(args.shadow_rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            proc, url = start_server(model_dir, args.device, **settings[mode])
            try:
                one_request = http_client(url, None, args.max_tokens, texts)
                run_clients(Tally(), args.clients, 4, one_request)  # warm-up
                run_clients(tallies[mode], args.clients, args.phase, one_request)
                if mode == "on":
                    mirrored += scrape(url, "lmops:shadow_prompt_bits_per_byte_count", "challenger")
                    dropped += scrape(url, "lmops:shadow_prompts_dropped_total")
                    for role in sums:
                        sums[role] += scrape(url, "lmops:shadow_prompt_bits_per_byte_sum", role)
            finally:
                stop(proc)
    p95 = {mode: pct(t.ttft, 95) for mode, t in tallies.items()}
    return {
        "ttft_p95_off_ms": ms(p95["off"]),
        "ttft_p95_on_ms": ms(p95["on"]),
        "ttft_p95_on_over_off": round(p95["on"] / p95["off"], 3),
        "requests": {mode: t.requests for mode, t in tallies.items()},
        "mirrored_scored": mirrored,
        "mirror_dropped": dropped,
        "shadow_mean_bits_per_byte": {role: round(v / mirrored, 3) for role, v in sums.items()}
        if mirrored
        else {},
        "errors": sum(len(t.errors) for t in tallies.values()),
    }


def follow(model_dir: Path, tmp: Path, args, texts) -> tuple[dict, dict]:
    """The swap and memory measurements on a server following a registry alias."""
    registry = local_registry(tmp / "registry")
    registry.register(model_dir, "champion")
    registry.register(model_dir)
    proc, url = start_server(
        model_dir,
        args.device,
        LMOPS_MODEL_URI="models:/lmops@champion",
        LMOPS_MODEL_CACHE=str(tmp / "cache"),
        LMOPS_MODEL_POLL_S=str(args.poll_s),
        MLFLOW_TRACKING_URI=registry.uri,
        MLFLOW_DISABLE_TELEMETRY="true",
    )
    try:
        master = proc.pid
        one_request = http_client(url, None, args.max_tokens, texts)
        run_clients(Tally(), args.clients, 4, one_request)  # warm-up
        follower = Follower(registry, url)
        swap = swap_phases(follower, args, one_request)
        memory = memory_phase(follower, proc, args, one_request)
        swap["master_pid_kept"] = proc.poll() is None and proc.pid == master
    finally:
        stop(proc)
    return swap, memory


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--phase", type=float, default=12.0, help="seconds per steady, swap or shadow phase")
    ap.add_argument("--swaps", type=int, default=3)
    ap.add_argument("--memory-swaps", type=int, default=20)
    ap.add_argument("--shadow-rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--poll-s", type=float, default=ServiceConfig.model_fields["model_poll_s"].default)
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--only", choices=("swap", "shadow"), default=None, help="swap: swap and memory")
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="lmops-swap-"))
    model_dir = args.model_dir or build_random_model(tmp / "model")
    challenger = build_random_model(tmp / "challenger", seed=1)
    texts = prompts()
    load_before = os.getloadavg()
    result = {
        "workload": {
            "clients": args.clients,
            "phase_s": args.phase,
            "swaps": args.swaps,
            "max_tokens": args.max_tokens,
            "poll_s": args.poll_s,
            "compile": os.environ.get("LMOPS_COMPILE", "1"),
            "model": str(
                args.model_dir or "random weights, training default size (vocab 4096, 4 x 192, context 256)"
            ),
        },
    }
    targets, rows = {}, []
    if args.only != "shadow":
        swap, memory = follow(model_dir, tmp, args, texts)
        result.update(swap=swap, memory=memory)
        targets.update(
            {
                "zero_errors_in_swaps": swap["errors"] == 0 and memory["errors"] == 0,
                "master_pid_kept": swap["master_pid_kept"],
                "new_version_within_10_s": swap["swap_latency_max_s"] <= 10,
                "ttft_p99_during_swap_within_2x": swap["ttft_p99_swap_over_steady"] <= 2,
                "memory_back_to_steady_within_5%": memory["rss_last_over_first"] <= 1.05,
            }
        )
        rows += [
            ("swap latency, max of runs (s)", swap["swap_latency_max_s"], f"each: {swap['swap_latency_s']}"),
            (
                "TTFT p99 steady / during swap (ms)",
                swap["ttft_p99_steady_ms"],
                swap["ttft_p99_during_swap_ms"],
            ),
            ("TTFT p99 during swap / steady", swap["ttft_p99_swap_over_steady"], ""),
            (
                f"worker RSS after swap 1 / {memory['swaps']} (MiB)",
                memory["rss_first_mib"],
                memory["rss_last_mib"],
            ),
            ("errors (swap, memory)", swap["errors"], memory["errors"]),
        ]
    if args.only != "swap":
        shadow = shadow_phase(model_dir, challenger, args, texts)
        result["shadow"] = shadow
        targets.update(
            {
                "zero_errors_in_shadow": shadow["errors"] == 0,
                "shadow_10%_adds_at_most_5%_to_p95_ttft": shadow["ttft_p95_on_over_off"] <= 1.05,
            }
        )
        rows += [
            ("TTFT p95 shadow off / 10% (ms)", shadow["ttft_p95_off_ms"], shadow["ttft_p95_on_ms"]),
            (
                "TTFT p95 shadow 10% / off",
                shadow["ttft_p95_on_over_off"],
                f"mirrored {shadow['mirrored_scored']:.0f}",
            ),
            ("errors (shadow)", shadow["errors"], ""),
        ]
    result["machine"] = {
        "platform": platform.platform(),
        "cpu": cpu_description(),
        "cpus": os.cpu_count(),
        "device": args.device,
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }
    result["targets"] = targets
    print(f"\n{args.clients} streaming clients, {args.max_tokens} tokens each, {args.phase:.0f} s phases")
    for label, a, b in rows:
        print(f"{label:40}{a!s:>12}  {b}")
    print(f"targets: {result['targets']}")
    write_results(result, args.output or RESULTS / f"swap-{args.device}.json")


if __name__ == "__main__":
    main()
