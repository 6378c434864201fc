"""The data stages at scale: get_data, split and tokenize on generated line-per-record corpora
(100 MB and 1 GB; --quick: 10 MB and 40 MB), each stage a subprocess timed and measured for
peak RSS (os.wait4), beside the baseline the issue sets: the trained tokenizer's raw
`encode_batch` over the same text with all cores, in the same run.

    python benchmarks/data.py [--quick] [--sizes MB MB] [--work DIR]

Prints a table and writes benchmarks/results/data-cpu.json. Targets (issue 21): every stage's
peak RSS <= 1.5 GB at the larger size and within 1.2x of its peak at the smaller; the three
stages together <= 2x the raw encode_batch time; the larger size's total time <= 11x the smaller's
(for 100 MB -> 1 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results" / "data-cpu.json"
STAGES = ("get_data", "split", "tokenize")


def generate(path: Path, size: int, seed: int = 0) -> None:
    """Unique lines (a record number, then words drawn by a Zipf law from a 20,000-word lexicon)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lexicon = ["".join(rng.choice(letters, rng.integers(2, 11))) for _ in range(20_000)]
    written, n = 0, 0
    with open(path, "w") as fh:
        while written < size:
            ranks = rng.zipf(1.2, (10_000, 14)) % len(lexicon)
            block = "".join(
                f"{n + i} " + " ".join(lexicon[r] for r in row) + ".\n" for i, row in enumerate(ranks)
            )
            n += len(ranks)
            fh.write(block)
            written += len(block)


def run_stage(project: Path, stage: str) -> dict:
    """One stage as `lmops <stage>` in its own process: wall time and peak RSS."""
    return run_measured([sys.executable, "-m", "lmops.pipeline.cli", stage], project)[0]


def run_measured(cmd: list[str], cwd: Path) -> tuple[dict, str]:
    """`cmd` in its own process: its wall time and peak RSS (os.wait4), and its stdout."""
    started = time.perf_counter()
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=stderr)
        stdout = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status):
            stderr.seek(0)
            sys.exit(f"{cmd[-1][:60]!r} failed: {stderr.read().decode()[-2000:]}")
    measured = {
        "seconds": round(time.perf_counter() - started, 2),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
    }
    return measured, stdout.decode()


def raw_encode(project: Path) -> float:
    """Seconds for the trained tokenizer's encode_batch over the three splits (pieces as the runtime cuts them)."""
    code = """
import sys, time
from pathlib import Path
from lmops.runtime.tokenizer import chunks, load_tokenizer
tok = load_tokenizer("artifacts/tokenizer")
total = 0.0
for name in ("train", "val", "test"):
    path = Path(f"data/processed/{name}.txt")
    with open(path, encoding="utf-8") as fh:
        while block := fh.read(64 << 20) + fh.readline():  # 64 MB of whole lines at a time
            pieces = list(chunks(block))
            started = time.perf_counter()
            tok.encode_batch(pieces, add_special_tokens=False)
            total += time.perf_counter() - started
print(total)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=project, check=True, capture_output=True, text=True
    )
    return round(float(out.stdout.strip()), 2)


def measure(work: Path, mb: int) -> dict:
    project = work / f"{mb}mb"
    project.mkdir(parents=True, exist_ok=True)
    corpus = project / "corpus.txt"
    if not corpus.is_file() or corpus.stat().st_size < mb * 1_000_000:
        generate(corpus, mb * 1_000_000)
    (project / "params.yaml").write_text("data: {source: corpus.txt}\n")  # repo defaults otherwise
    stages = {stage: run_stage(project, stage) for stage in STAGES}
    total = round(sum(s["seconds"] for s in stages.values()), 2)
    baseline = raw_encode(project)
    index = json.loads((project / "data/processed/tokens/index.json").read_text())
    stats = json.loads((project / "artifacts/tokenizer/stats.json").read_text())
    return {
        "corpus_bytes": corpus.stat().st_size,
        "stages": stages,
        "total_seconds": total,
        "raw_encode_batch_seconds": baseline,
        "total_over_raw_encode": round(total / baseline, 2),
        "tokens": sum(s["tokens"] for s in index["splits"].values()),
        "shards": sum(len(s["shards"]) for s in index["splits"].values()),
        "tokenizer_trained_on_bytes": stats["trained_on_bytes"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 MB and 40 MB")
    parser.add_argument(
        "--sizes", type=int, nargs=2, metavar="MB", help="the two corpus sizes (default 100 1000)"
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/lmops-data-bench"))
    args = parser.parse_args()
    sizes = args.sizes or ([10, 40] if args.quick else [100, 1000])
    runs = {f"{mb}MB": measure(args.work, mb) for mb in sizes}
    small, big = runs[f"{sizes[0]}MB"], runs[f"{sizes[1]}MB"]
    checks = {
        "peak_rss_at_most_1.5GB": all(s["peak_rss_mb"] <= 1536 for s in big["stages"].values()),
        "peak_rss_within_1.2x": all(
            big["stages"][k]["peak_rss_mb"] <= 1.2 * small["stages"][k]["peak_rss_mb"] for k in STAGES
        ),
        "stages_at_most_2x_raw_encode": big["total_over_raw_encode"] <= 2.0,
        "time_growth": round(big["total_seconds"] / small["total_seconds"], 2),
        "time_growth_at_most_size_ratio_x1.1": big["total_seconds"] / small["total_seconds"]
        <= 1.1 * sizes[1] / sizes[0],
    }
    print(f"{'corpus':>8} {'stage':>9} {'seconds':>8} {'peak RSS MB':>12}")
    for name, r in runs.items():
        for stage, s in r["stages"].items():
            print(f"{name:>8} {stage:>9} {s['seconds']:>8} {s['peak_rss_mb']:>12}")
        print(
            f"{name:>8} {'total':>9} {r['total_seconds']:>8}   raw encode_batch {r['raw_encode_batch_seconds']} s "
            f"(x{r['total_over_raw_encode']}), {r['tokens']} tokens, {r['shards']} shards"
        )
    print(json.dumps(checks))
    result = {
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "sizes_mb": sizes,
        "runs": runs,
        "checks": checks,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
