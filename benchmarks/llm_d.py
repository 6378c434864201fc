"""What llm-d asks of the engine, measured: priority scheduling and KV-cache events.

    python benchmarks/llm_d.py [--quick] [--device auto|cpu|cuda]

Both parts run the default-size random model (benchmarks/engine.py's) on the engine alone.

  priority  A full queue: all requests submitted at once, half at priority 0 and half at
            priority 10, interleaved, to an engine that runs 4 at a time. p95 queue time
            (arrival to first scheduling) of each half under LMOPS_SCHEDULING_POLICY=priority,
            and, as the baseline in the same run, under fcfs (the same two halves, every
            request at priority 0, which fcfs requires). Target: priority-0 p95 at most
            0.5x priority-10 p95. The two policies take turns over --rounds rounds and the
            median ratio is reported (a stall of the shared box during a round delays both
            halves alike); so is the ratio in engine steps before a request's first, which
            is what the scheduler decided, whatever the load.
  events    Output tokens/s of a batch of requests with KV-cache events published (ZMQ
            PUB to a subscriber on 127.0.0.1 that decodes every batch, replay socket on)
            against events off, alternating runs, the median of each. Target: >= 0.95x.
            On a shared box the runs' spread can exceed the difference, so the share of
            the on-runs' time spent publishing (encoding and sending, timed around each
            call) is reported too: the cost that remains when the noise is taken out.

Prints a table; writes benchmarks/results/llm-d-<device>.json, with the load average.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch
import zmq
from engine import RESULTS, build_random_model, write_results

from lmops.runtime.engine import LLMEngine, SamplingParams
from lmops.runtime.engine.config import KVEventsConfig
from lmops.runtime.model import resolve_device


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[94]


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Distinct prompts (no shared prefixes: every block is new to the cache)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (length,), generator=g).tolist() for _ in range(count)]


def queue_times(engine: LLMEngine, policy: str, count: int) -> tuple[dict, dict]:
    """Queue time of each request of the two interleaved halves (class 0 and class 10), in
    seconds and in engine steps (steps run before its first)."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    classes = {}
    for i, ids in enumerate(prompts(count, 64, engine.model_config.vocab_size, seed=1)):
        cls = 0 if i % 2 else 10
        req = engine.make_request(str(i), ids, params, cls if policy == "priority" else 0)
        engine.add_request(None, req)
        classes[str(i)] = (cls, req)
    steps: dict[int, list[int]] = {0: [], 10: []}
    waiting, step = dict(classes), 0
    while engine.has_unfinished_requests():
        engine.step()
        for rid, (cls, req) in list(waiting.items()):
            if req.metrics.first_scheduled_time is not None:
                steps[cls].append(step)
                del waiting[rid]
        step += 1
    seconds: dict[int, list[float]] = {0: [], 10: []}
    for cls, req in classes.values():
        seconds[cls].append(req.metrics.queue_time)
    return seconds, steps


def priority_rounds(model_dir: Path, device: str, count: int, rounds: int) -> dict:
    """fcfs and priority taking turns, `rounds` times; the median ratios."""
    engines = {
        policy: LLMEngine.from_pretrained(model_dir, device=device, scheduling_policy=policy, max_num_seqs=4)
        for policy in ("fcfs", "priority")
    }
    for engine in engines.values():  # warm-up: a full wave
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        engine.generate(prompts(4, 64, engine.model_config.vocab_size, seed=0), [params] * 4)
    results: dict[str, list[dict]] = {"fcfs": [], "priority": []}
    for _ in range(rounds):
        for policy, engine in engines.items():
            engine.reset_prefix_cache()
            seconds, steps = queue_times(engine, policy, count)
            results[policy].append(
                {
                    "p95_queue_s": {str(c): round(p95(v), 4) for c, v in seconds.items()},
                    "p95_queue_steps": {str(c): p95(v) for c, v in steps.items()},
                }
            )

    def ratios(policy: str, key: str) -> list[float]:
        return [round(r[key]["0"] / r[key]["10"], 3) for r in results[policy]]

    return {
        "requests": count,
        "max_num_seqs": 4,
        "rounds": results,
        "ratios_p0_over_p10": ratios("priority", "p95_queue_s"),
        "ratio_p0_over_p10": statistics.median(ratios("priority", "p95_queue_s")),
        "baseline_fcfs_ratio": statistics.median(ratios("fcfs", "p95_queue_s")),
        "ratio_p0_over_p10_steps": statistics.median(ratios("priority", "p95_queue_steps")),
        "baseline_fcfs_ratio_steps": statistics.median(ratios("fcfs", "p95_queue_steps")),
        "target": "<= 0.5",
    }


def subscribe(endpoint: str, ready, results) -> None:
    """Receive and decode every event batch until told to stop, as llm-d's indexer does, in
    a process of its own (as the picker is): what the engine pays is encoding and sending."""
    sock = zmq.Context().socket(zmq.SUB)
    sock.bind(endpoint)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    ready.set()
    decoder = msgspec.msgpack.Decoder()
    batches = events = 0
    while not results.poll():
        if sock.poll(100):
            _, _, payload = sock.recv_multipart()
            events += len(decoder.decode(payload)[1])
            batches += 1
    results.recv()
    results.send((batches, events))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def throughput(engine: LLMEngine, batch: list[list[int]]) -> float:
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    engine.reset_prefix_cache()  # every run stores (and evicts) the same blocks afresh
    t = time.perf_counter()
    outs = engine.generate(batch, [params] * len(batch))
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer requests and repetitions")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of fcfs and priority taking turns")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = resolve_device(args.device)
    load_before = os.getloadavg()
    count, reps = (24, 2) if args.quick else (48, 5)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_model(Path(tmp) / "model", 1024)
        res: dict = {"device": str(device), "platform": platform.platform(), "torch": torch.__version__}
        print(
            f"priority: {count} requests (half priority 0, half 10) queued at once, 4 running",
            file=sys.stderr,
        )
        res["priority"] = priority_rounds(model_dir, str(device), count, args.rounds)
        print(
            f"events: {reps} alternating runs of 32 requests x (128 prompt + 32 new tokens)", file=sys.stderr
        )
        port, replay = free_port(), free_port()
        ready, (ours, theirs) = multiprocessing.Event(), multiprocessing.Pipe()
        sub = multiprocessing.Process(target=subscribe, args=(f"tcp://127.0.0.1:{port}", ready, theirs))
        sub.start()
        ready.wait(30)
        config = KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=f"tcp://127.0.0.1:{port}",
            replay_endpoint=f"tcp://127.0.0.1:{replay}",
            topic="kv@bench@lmops",
        )
        engines = {
            "off": LLMEngine.from_pretrained(model_dir, device=str(device)),
            "on": LLMEngine.from_pretrained(model_dir, device=str(device), kv_events_config=config),
        }
        batch = prompts(32, 128, engines["off"].model_config.vocab_size, seed=2)
        for engine in engines.values():
            throughput(engine, batch)  # warm-up
        publisher, publishing = engines["on"].kv_events, []
        send = publisher.publish

        def timed_publish(events):
            t = time.perf_counter()
            send(events)
            publishing.append(time.perf_counter() - t)

        publisher.publish = timed_publish
        runs: dict[str, list[float]] = {"off": [], "on": []}
        on_seconds = 0.0
        for i in range(reps):
            for name in ("off", "on") if i % 2 else ("on", "off"):  # neither always goes first
                t = time.perf_counter()
                runs[name].append(throughput(engines[name], batch))
                on_seconds += (time.perf_counter() - t) if name == "on" else 0.0
        time.sleep(0.5)  # the last batches reach the subscriber
        ours.send("stop")
        batches, events = ours.recv()
        sub.join(10)
        engines["on"].close()
        median = {name: statistics.median(values) for name, values in runs.items()}
        res["events"] = {
            "requests": 32,
            "repetitions": reps,
            "tokens_per_s": {name: [round(v, 1) for v in values] for name, values in runs.items()},
            "median_tokens_per_s": {name: round(v, 1) for name, v in median.items()},
            "ratio_on_over_off": round(median["on"] / median["off"], 3),
            "publish_share_of_on_time": round(sum(publishing) / on_seconds, 5),
            "publish_calls": len(publishing),
            "batches_received": batches,
            "events_received": events,
            "target": ">= 0.95",
        }
    res["load_average_before_after"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    pr, ev = res["priority"], res["events"]
    print(f"\n{'measure':<44}{'value':>12}{'target':>10}")
    for policy in ("fcfs", "priority"):
        last = pr["rounds"][policy][-1]
        sec, steps = last["p95_queue_s"], last["p95_queue_steps"]
        value = f"{sec['0']:.2f}s {steps['0']:.0f} / {sec['10']:.2f}s {steps['10']:.0f}"
        print(f"{f'p95 queue s, steps ({policy}, last): p0 / p10':<44}{value:>22}")
    value = f"{pr['ratio_p0_over_p10']:.3f} ({pr['baseline_fcfs_ratio']:.3f})"
    print(f"{'ratio p0/p10 in s, median (fcfs)':<44}{value:>22}{'<= 0.5':>10}")
    value = f"{pr['ratio_p0_over_p10_steps']:.3f} ({pr['baseline_fcfs_ratio_steps']:.3f})"
    print(f"{'ratio p0/p10 in steps, median (fcfs)':<44}{value:>22}")
    m = ev["median_tokens_per_s"]
    print(f"{'tokens/s, events off / on (median)':<44}{m['off']:>6.0f}/{m['on']:<5.0f}")
    print(f"{'ratio on/off':<44}{ev['ratio_on_over_off']:>22.3f}{'>= 0.95':>10}")
    print(f"{'share of the on-runs spent publishing':<44}{ev['publish_share_of_on_time']:>22.5f}")
    print(f"{'event batches / events received':<44}{ev['batches_received']:>6}/{ev['events_received']:<5}")
    print(f"load average (1 min) before/after: {res['load_average_before_after']}")
    write_results(res, args.out or RESULTS / f"llm-d-{device.type}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
