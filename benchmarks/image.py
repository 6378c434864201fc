"""Single stream through the CPU image: compiled decode (the image's default, with its g++)
against eager (`LMOPS_COMPILE=0`, how the image decoded before it carried a compiler), and a
second compiled container started on the first one's compile cache (`cached`: a named volume
at /var/cache/lmops, as compose and the Kubernetes overlays share it between replicas). The
containers of one image run at once, served as production does (`--read-only`, a tmpfs
/tmp, the model mounted read-only), and 1-client rounds of streaming completions alternate
between them, so background load hits all alike. Each start is timed to /ready: the
compiled one compiles its decode graphs first (the volume starts empty), the cached one
loads them.

    python benchmarks/image.py [--image lmops:image-test] [--model artifacts/model]
                               [--duration 120] [--rounds 6] [--max-tokens 128] [--out FILE]

Build the image first (`make image`, or `make image-test`, which tags lmops:image-test).
Uses docker when its daemon answers, else podman. Prints a table; writes JSON
(benchmarks/results/image-cpu.json by default).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import RESULTS, cpu_description, write_results  # noqa: E402
from load import Tally, http_client, prompts, run_clients, summary  # noqa: E402

# LMOPS_COMPILE (a compiling container keeps its graphs in the shared compile cache); in start
# order (the cached one starts once the compiled one has filled the cache).
MODES = {"compiled": "1", "cached": "1", "eager": "0"}
CACHE_DIR = "/var/cache/lmops"
# podman without CAP_SYS_RESOURCE cannot raise its defaults (deploy/image_test.sh); docker
# takes them too.
ULIMITS = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768"]
READY_TIMEOUT_S = 900


def container_engine() -> str:
    try:
        if subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
            return "docker"
    except FileNotFoundError:
        pass
    return "podman"


def serve(engine: str, image: str, model: Path, mode: str, cache: str) -> tuple[str, str, float]:
    """Start the image on `model` in `mode`, with the volume `cache` as its compile cache when
    it compiles; its name, URL and seconds to /ready."""
    name = f"lmops-bench-image-{os.getpid()}-{mode}"
    started = time.monotonic()
    run = [engine, "run", "--detach", "--name", name, "--read-only", "--tmpfs", "/tmp:rw,mode=1777"]
    run += [
        *ULIMITS,
        "--publish",
        "127.0.0.1::5001",
        "--volume",
        f"{model.resolve()}:/app/production_service/model:ro",
    ]
    if MODES[mode] == "1":
        run += ["--volume", f"{cache}:{CACHE_DIR}", "--env", f"TORCHINDUCTOR_CACHE_DIR={CACHE_DIR}/inductor"]
    subprocess.run([*run, "--env", f"LMOPS_COMPILE={MODES[mode]}", image], check=True, capture_output=True)
    port = subprocess.run([engine, "port", name, "5001"], check=True, capture_output=True, text=True)
    url = "http://" + port.stdout.split()[0].replace("0.0.0.0", "127.0.0.1")
    while time.monotonic() - started < READY_TIMEOUT_S:
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2):
                return name, url, time.monotonic() - started
        except OSError:
            time.sleep(0.5)
    logs = subprocess.run([engine, "logs", name], capture_output=True, text=True)
    raise SystemExit(
        f"{mode}: not ready after {READY_TIMEOUT_S} s\n{logs.stdout[-3000:]}{logs.stderr[-3000:]}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", default="lmops:image-test")
    ap.add_argument("--model", type=Path, default=Path("artifacts/model"))
    ap.add_argument("--duration", type=float, default=120.0, help="seconds per mode, over all rounds")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=RESULTS / "image-cpu.json")
    args = ap.parse_args()
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"{args.model}: no model directory (make run, or --model DIR)")

    engine, texts = container_engine(), prompts()
    load_before = os.getloadavg()[0]
    containers, clients, ready_s = [], {}, {}
    cache = f"lmops-bench-image-{os.getpid()}-compile-cache"
    subprocess.run([engine, "volume", "create", cache], check=True, capture_output=True)
    try:
        for mode in MODES:
            name, url, ready_s[mode] = serve(engine, args.image, args.model, mode, cache)
            containers.append(name)
            clients[mode] = http_client(url, None, args.max_tokens, texts)
            run_clients(Tally(), 1, 10, clients[mode])  # warm-up
        tallies = {mode: Tally() for mode in MODES}
        elapsed = dict.fromkeys(MODES, 0.0)
        for _ in range(args.rounds):
            for mode, one_request in clients.items():
                elapsed[mode] += run_clients(tallies[mode], 1, args.duration / args.rounds, one_request)
    finally:
        for name in containers:
            subprocess.run([engine, "rm", "--force", name], capture_output=True)
        subprocess.run([engine, "volume", "rm", "--force", cache], capture_output=True)

    modes = {
        mode: {**summary(tallies[mode], elapsed[mode]), "ready_s": round(ready_s[mode], 1)} for mode in MODES
    }
    tok_s = {mode: m["output_tokens_per_s"] for mode, m in modes.items()}
    ratio, cached_ratio = tok_s["compiled"] / tok_s["eager"], tok_s["cached"] / tok_s["compiled"]
    print(f"{args.image} on {cpu_description()}, {args.model}, 1 client, {args.max_tokens} tokens a request")
    print(
        f"{'mode':<10}{'ready s':>9}{'requests':>10}{'tok/s':>8}{'TTFT p50 ms':>13}{'ITL p50 ms':>12}{'errors':>8}"
    )
    for mode, m in modes.items():
        print(
            f"{mode:<10}{m['ready_s']:>9}{m['requests']:>10}{m['output_tokens_per_s']:>8}"
            f"{m['ttft_p50_ms']:>13}{m['itl_p50_ms']:>12}{m['errors']:>8}"
        )
    print(f"compiled / eager tokens/s: {ratio:.2f}x; cached / compiled: {cached_ratio:.2f}x")
    result = {
        "image": args.image,
        "container_engine": engine,
        "model": str(args.model),
        "cpu": cpu_description(),
        "cpus": os.cpu_count(),
        "workload": {
            "clients": 1,
            "duration_s": args.duration,
            "rounds": args.rounds,
            "max_tokens": args.max_tokens,
        },
        "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "modes": modes,
        "compiled_over_eager_tokens_per_s": round(ratio, 3),
        "cached_over_compiled_tokens_per_s": round(cached_ratio, 3),
    }
    write_results(result, args.out)


if __name__ == "__main__":
    main()
