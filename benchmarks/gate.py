"""What the promotion gate says about noise and about progress, measured: retrains of one
recipe that differ only in `train.seed`, and the same recipe trained several times longer,
each compared with the first seed's model on the same test units.

    python benchmarks/gate.py [--steps 250] [--seeds 3] [--longer 4] [--max-bytes 8000000]

One project in a temporary directory: the default params.yaml (the default corpus,
capped at --max-bytes, and the default model), get_data/split/tokenize once, then per
run `lmops train` (train.seed, train.max_steps) and `lmops evaluate`, keeping each run's
artifacts/eval/units.csv. Every run is compared with the first seed's units by
lmops.pipeline.gate (the same bootstrap, confidence and seed as `lmops promote`), and the
table says whether promote.min_improvement would promote it. Prints a table; writes
benchmarks/results/gate-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from lmops.pipeline import gate
from lmops.pipeline.evaluate import read_units, summarize
from lmops.pipeline.params import PromoteConfig

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def cpu() -> dict:
    """The CPU's model and the vector flags that decide the kernels (speeds differ by them)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next(
        (line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), None
    )
    flags = sorted({f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in info})
    return {"cpu_model": model, "cpu_flags": flags}


def lmops(work: Path, *args: str) -> None:
    subprocess.run([str(Path(sys.executable).parent / "lmops"), *args], cwd=work, check=True)


def train_and_score(work: Path, base: dict, seed: int, steps: int) -> tuple[list[dict], float, float]:
    params = json.loads(json.dumps(base))
    params["train"].update(seed=seed, max_steps=steps)
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.rmtree(work / "artifacts/checkpoints", ignore_errors=True)  # a fresh run, not a resume
    t0 = time.perf_counter()
    lmops(work, "train")
    seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    lmops(work, "evaluate")
    return read_units(work / "artifacts/eval/units.csv"), seconds, time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--longer", type=int, default=4, help="the long run trains this many times the steps")
    parser.add_argument("--max-bytes", type=int, default=8_000_000)
    args = parser.parse_args()
    cfg = PromoteConfig()
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    base["data"]["max_bytes"] = args.max_bytes
    base["mlflow"]["tracking_uri"] = "sqlite:///mlflow.db"
    runs = [(f"seed {s}", s, args.steps) for s in range(1, args.seeds + 1)]
    runs.append((f"seed 1, {args.longer}x steps", 1, args.longer * args.steps))
    work = Path(tempfile.mkdtemp(prefix="lmops-gate-bench-"))
    try:
        shutil.copy(REPO / "dvc.yaml", work)
        (work / "params.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
        env_note = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS",)}
        for stage in ("get_data", "split", "tokenize"):
            lmops(work, stage)
        scored = {}
        for name, seed, steps in runs:
            units, train_s, evaluate_s = train_and_score(work, base, seed, steps)
            scored[name] = {"units": units, "train_s": round(train_s, 1), "evaluate_s": round(evaluate_s, 1)}
            scored[name]["steps"] = steps
    finally:
        shutil.rmtree(work, ignore_errors=True)

    reference = scored[runs[0][0]]["units"]
    rows = []
    for name, _, steps in runs:
        units = scored[name]["units"]
        row = {
            "run": name,
            "steps": steps,
            "train_s": scored[name]["train_s"],
            "evaluate_s": scored[name]["evaluate_s"],
            "bits_per_byte": summarize(units)["bits_per_byte"],
        }
        if name != runs[0][0]:
            comparison = gate.paired_bootstrap(
                units, reference, cfg.bootstrap_samples, cfg.confidence, cfg.seed
            )
            row.update(
                delta=comparison.delta_bits_per_byte,
                interval=list(comparison.interval),
                units=comparison.units,
                promoted=gate.better(comparison, cfg)[0],
            )
        rows.append(row)

    print(f"\nvs {runs[0][0]}; rule: {gate.rule(cfg)}")
    header = f"{'run':<24} {'steps':>6} {'train s':>8} {'eval s':>7} {'bits/byte':>10} {'delta':>8}"
    print(f"{header} {'interval':>20} {'promoted':>9}")
    for r in rows:
        interval = f"[{r['interval'][0]:+.4f}, {r['interval'][1]:+.4f}]" if "interval" in r else ""
        delta = f"{r['delta']:+.4f}" if "delta" in r else ""
        promoted = str(r.get("promoted", "")) if "delta" in r else "(reference)"
        print(
            f"{r['run']:<24} {r['steps']:>6} {r['train_s']:>8} {r['evaluate_s']:>7} {r['bits_per_byte']:>10.4f} "
            f"{delta:>8} "
            f"{interval:>20} {promoted:>9}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "gate-cpu.json"
    result = {
        "args": vars(args),
        "rule": gate.rule(cfg),
        "rows": rows,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), **cpu(), **env_note},
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
