"""What llm-d asks of the engine, measured: priority scheduling and KV-cache events.

    python benchmarks/llm_d.py [--quick] [--device auto|cpu|cuda]

Both parts run the default-size random model (benchmarks/engine.py's) on the engine alone.

  priority  A full queue: all requests submitted at once, half at priority 0 and half at
            priority 10, interleaved, to an engine that runs 4 at a time. p95 queue time
            (arrival to first scheduling) of each half under LMOPS_SCHEDULING_POLICY=priority,
            and, as the baseline in the same run, under fcfs (the same two halves, every
            request at priority 0, which fcfs requires). Target: priority-0 p95 at most
            0.5x priority-10 p95.
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


def queue_times(model_dir: Path, device: str, policy: str, count: int) -> dict[int, list[float]]:
    """Queue time of each request of the two interleaved halves (class 0 and class 10)."""
    engine = LLMEngine.from_pretrained(model_dir, device=device, scheduling_policy=policy, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine.generate(prompts(4, 64, engine.model_config.vocab_size, seed=0), params)  # warm-up: a full wave
    classes = {}
    for i, ids in enumerate(prompts(count, 64, engine.model_config.vocab_size, seed=1)):
        cls = 0 if i % 2 else 10
        priority = cls if policy == "priority" else 0
        req = engine.make_request(str(i), ids, params, priority)
        engine.add_request(None, req)
        classes[str(i)] = (cls, req)
    while engine.has_unfinished_requests():
        engine.step()
    times: dict[int, list[float]] = {0: [], 10: []}
    for cls, req in classes.values():
        times[cls].append(req.metrics.queue_time)
    return times


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
        rows = {}
        for policy in ("fcfs", "priority"):
            times = queue_times(model_dir, str(device), policy, count)
            rows[policy] = {cls: p95(values) for cls, values in times.items()}
        ratio = rows["priority"][0] / rows["priority"][10]
        res["priority"] = {
            "requests": count,
            "max_num_seqs": 4,
            "p95_queue_s": {
                policy: {str(k): round(v, 4) for k, v in r.items()} for policy, r in rows.items()
            },
            "ratio_p0_over_p10": round(ratio, 3),
            "baseline_fcfs_ratio": round(rows["fcfs"][0] / rows["fcfs"][10], 3),
            "target": "<= 0.5",
        }
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
        q = pr["p95_queue_s"][policy]
        print(f"{f'p95 queue s, {policy}: priority 0 / 10':<44}{q['0']:>6.3f}/{q['10']:<5.3f}")
    print(
        f"{'ratio p0/p10 (priority; fcfs baseline)':<44}{pr['ratio_p0_over_p10']:>6.3f}/{pr['baseline_fcfs_ratio']:<5.3f}{'<= 0.5':>10}"
    )
    m = ev["median_tokens_per_s"]
    print(f"{'tokens/s, events off / on (median)':<44}{m['off']:>6.0f}/{m['on']:<5.0f}")
    print(f"{'ratio on/off':<44}{ev['ratio_on_over_off']:>12.3f}{'>= 0.95':>10}")
    print(f"{'share of the on-runs spent publishing':<44}{ev['publish_share_of_on_time']:>12.5f}")
    print(f"{'event batches / events received':<44}{ev['batches_received']:>6}/{ev['events_received']:<5}")
    print(f"load average (1 min) before/after: {res['load_average_before_after']}")
    write_results(res, args.out or RESULTS / f"llm-d-{device.type}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
