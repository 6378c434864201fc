"""Single-stream latency: one request at a time, the engine as it is against the engine at
a baseline commit, in one run.

    python benchmarks/single_stream.py [--baseline REV] [--threads 1 2] [--rounds 7] [--speculative 4]
        [--scheduler-steps 4] [--draft-model target|tiny|DIR] [--model DIR --prompts-from TEXT [--num-prompts 8]] [--int8]
        [--malloc glibc tcmalloc] [--concurrency 8] [--quick]

All engines run the same random default-size model (benchmarks/engine.py's, context 1024)
and the same greedy request (128-token prompt, 128 new tokens, EOS ignored), compiled decode
on (the default); or, with `--model` and `--prompts-from`, a trained model on prompts taken
from a text file (the corpus's test split: code completions of the default corpus), each
prompt once a round. Each (engine, thread count) is a worker process of its own: the baseline's
with `git archive REV src` on its PYTHONPATH, so each loads its own `lmops`; inductor's
graphs are compiled for one thread count, hence a worker per count. The workers take turns
request by request for `--rounds` rounds (medians), so load from other jobs falls on all alike,
each request after a pause in which the cores go idle (`IDLE_BEFORE_REQUEST`).
Decode tok/s = 127 / (last token - first token), by the wall clock and by the worker's CPU
time over the same steps (on a shared machine the CPU time is the steadier figure: it leaves
out the time other jobs held the core); TTFT from the request's metrics, each prompt cold (lmops'
prefix cache is reset before every request: the rounds repeat the prompts, and CTranslate2
caches none). `--speculative K`
adds a third worker: the engine as it is with `num_speculative_tokens=K` (and its
acceptance rate: accepted / drafted tokens), its drafts from prompt lookup; `--draft-model`
adds a fourth, its drafts from a draft model: `target` (the benchmark's model as its own
draft: every draft kept, so it measures what drafting costs), `tiny` (a random tiny model
with the same tokenizer) or a model directory (one the pipeline
trained with a smaller `model.*`: README, "Speculative decoding"). Each engine runs with its own defaults (the engine as
it is: multi-step decoding, 8 steps a graph call); `--scheduler-steps S` adds the engine as it is
with `num_scheduler_steps=S` (1: one step a call). `--ctranslate2` adds CTranslate2's Generator
on the same model (fp32, converted by its own Transformers converter; through
`generate_tokens`) twice, once with each of its CPU GEMM backends: Intel MKL
(`ctranslate2-mkl`, its default on Intel CPUs) and oneDNN (`ctranslate2-dnnl`, its default on
others), chosen by its `CT2_USE_MKL`. Neither is best everywhere (on a 2-core Xeon, MKL runs 2
threads at a seventh of its 1-thread speed and oneDNN does not), so each lmops engine is also
given against CTranslate2's best backend at that thread count (`vs_ctranslate2`: the ratio of
median tok/s, and per request, paired with the same request's run). Every worker's greedy
tokens must be the baseline's. `--sampling
temperature=0.8 top_p=0.95 ...` makes every request a sampled one with those
SamplingParams fields (CTranslate2's: temperature, top_k and top_p; the same count of
tokens, each engine's own draws, not compared). `--int8` gives every engine int8 weights
(lmops's `quantization="int8"`, CTranslate2's int8 compute type; CTranslate2's tokens, from
its own quantization, are not compared). `--malloc A [B ...]`: every worker runs under
allocator A (glibc's own, or tcmalloc or jemalloc preloaded, as the service's serving_env
preloads one); each further allocator B adds the engine as it is and CTranslate2's backends
again under B (`now@B`, `ctranslate2-dnnl@B`, ...), so the allocator's effect on each is
measured in the same run. `--concurrency N` submits each request N times at once, so the
lmops engines decode batches of N (tok/s over all N; not with `--ctranslate2`). Writes
benchmarks/results/single-stream-cpu.json.
"""

from __future__ import annotations

import argparse
import ctypes.util
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from engine import RESULTS, build_random_model, convert_to_ctranslate2, cpu_description, write_results

from lmops.runtime.model_config import TINY_SHAPE

REPO = Path(__file__).resolve().parents[1]
# The engine before issue 34 (the four-verb step, one forward, the latency work).
BASELINE = "6045f25"
PROMPT_LEN = 128
# CTranslate2's CPU GEMM backends, as its CT2_USE_MKL chooses them.
CT2_BACKENDS = {"ctranslate2-mkl": "1", "ctranslate2-dnnl": "0"}
# The allocators a worker can run under (`--malloc`): glibc's, or a library preloaded, as
# production_service/server.py's serving_env preloads one for the service.
MALLOCS = {"glibc": None, "tcmalloc": "tcmalloc_minimal", "jemalloc": "jemalloc"}
# A pause before each request: longer than the spin of libgomp's threads after a parallel
# region (GOMP_SPINCOUNT's default, about 8 ms on a 2-core EPYC), so that each request starts on
# cores the previous worker's threads have left, as a request to a service alone on its cores
# does (without it, a 2-thread worker's TTFT measured the worker before it: benchmarks/README.md,
# "The prefill in a graph").
IDLE_BEFORE_REQUEST = 0.05


def engines(row: dict) -> list[str]:
    """A thread count's engines, in the order they ran (`name` or `name@malloc`)."""
    return [n for n, x in row.items() if isinstance(x, dict) and "runs" in x]


def is_ctranslate2(name: str) -> bool:
    return name.split("@")[0] in CT2_BACKENDS


def worker(
    model_dir: Path,
    threads: int,
    speculative: int,
    draft_dir: Path | None,
    steps: int | None,
    sampling: dict,
    int8: bool,
    concurrency: int,
) -> None:
    """Serve requests from stdin (one JSON line: prompt ids and new tokens), answer one JSON
    line each; greedy, or `sampling`'s SamplingParams fields; `int8`: int8 weights; `steps`:
    num_scheduler_steps (None: the engine's default); each request `concurrency` times at once
    (decode tok/s: all their tokens after the first over the time from the first first token
    to the last token; the CPU time from the step that gave every copy its first token)."""
    import torch

    torch.set_num_threads(threads)
    from lmops.runtime.engine import LLMEngine, SamplingParams

    spec = {"num_speculative_tokens": speculative} if speculative else {}
    if draft_dir is not None:
        spec["speculative_model"] = str(draft_dir)
    if steps is not None:
        spec["num_scheduler_steps"] = steps
    if int8:
        spec["quantization"] = "int8"
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", compile=True, drift_sample=0, **spec)
    print(json.dumps({"ready": True, "compiled": engine.runner.decode is not None}), flush=True)
    for i, line in enumerate(sys.stdin):
        ask = json.loads(line)
        prompt, new = ask["prompt"], ask["new"]
        engine.reset_metrics()
        engine.reset_prefix_cache()  # a cold prompt each time: the rounds repeat the prompts
        params = SamplingParams(**{"temperature": 0, **sampling}, max_tokens=new, ignore_eos=True)
        for j in range(concurrency):
            engine.add_request(f"{i}.{j}", prompt, params)
        outs, cpu = {}, None
        while engine.has_unfinished_requests():
            outs |= {out.request_id: out for out in engine.step()}
            if cpu is None and len(outs) == concurrency:  # every copy has its first token
                cpu = time.process_time()
        cpu = time.process_time() - cpu
        done = [outs[f"{i}.{j}"] for j in range(concurrency)]
        metrics = [out.metrics for out in done]
        first, last = min(m.first_token_time for m in metrics), max(m.last_token_time for m in metrics)
        result = {
            "decode_tok_s": concurrency * (new - 1) / (last - first),
            "decode_cpu_tok_s": concurrency * (new - 1) / cpu,
            "ttft_ms": 1000 * max(m.ttft for m in metrics),
        }
        value = engine.metrics.registry.get_sample_value
        if speculative:
            drafted = value("lmops:spec_decode_num_draft_tokens_total")
            result["acceptance"] = value("lmops:spec_decode_num_accepted_tokens_total") / max(drafted, 1)
        print(json.dumps({**result, "tokens": [out.token_ids for out in done]}), flush=True)


def ctranslate2_worker(ct2_dir: Path, model_dir: Path, threads: int, sampling: dict, int8: bool) -> None:
    """`worker` for CTranslate2's Generator (engine.py's CT2: fp32, or its int8 compute type;
    EOS ignored; greedy, or `sampling`'s temperature, top_k and top_p): the same protocol, the
    same figures, timed at the tokens its `generate_tokens` streams."""
    from engine import CT2

    ct2 = CT2(ct2_dir, model_dir, "int8" if int8 else "float32", threads)
    print(json.dumps({"ready": True, "compiled": False}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        new = ask["new"]
        start, times, tokens = time.perf_counter(), [], []
        for token in ct2.stream(ask["prompt"], new, sampling):
            times.append(time.perf_counter())
            tokens.append(token)
            if len(times) == 1:
                cpu = time.process_time()
        result = {
            "decode_tok_s": (new - 1) / (times[-1] - times[0]),
            "decode_cpu_tok_s": (new - 1) / (time.process_time() - cpu),
            "ttft_ms": 1000 * (times[0] - start),
        }
        print(json.dumps({**result, "tokens": [tokens]}), flush=True)


class Worker:
    def __init__(
        self,
        model_dir: Path,
        threads: int,
        src: Path,
        speculative: int = 0,
        draft_dir: Path | None = None,
        ct2_dir: Path | None = None,
        steps: int | None = None,
        sampling: dict | None = None,
        int8: bool = False,
        use_mkl: str | None = None,
        malloc: str = "glibc",
        concurrency: int = 1,
    ):
        """An lmops worker with `src` on its path; with `ct2_dir` (`convert_to_ctranslate2`), a
        CTranslate2 one, on MKL (`use_mkl` "1") or oneDNN ("0"); under `malloc` (MALLOCS)."""
        env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(threads)}
        library = MALLOCS[malloc] and ctypes.util.find_library(MALLOCS[malloc])
        if MALLOCS[malloc] and not library:
            raise SystemExit(
                f"--malloc {malloc}: lib{MALLOCS[malloc]} is not installed (make system-tools brings tcmalloc)"
            )
        env["LD_PRELOAD"] = library or ""  # empty: glibc's malloc, whatever this process preloads
        if use_mkl is not None:
            env["CT2_USE_MKL"] = use_mkl
        cmd = [sys.executable, __file__, "--worker", str(model_dir), "--threads", str(threads)]
        cmd += ["--speculative", str(speculative)] + ["--scheduler-steps", str(steps)] * (steps is not None)
        cmd += ["--sampling-json", json.dumps(sampling or {})] + ["--int8"] * int8
        cmd += ["--concurrency", str(concurrency)]
        if speculative and draft_dir is not None:
            cmd += ["--draft-dir", str(draft_dir)]
        if ct2_dir is not None:
            cmd += ["--ctranslate2-dir", str(ct2_dir)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait()}")
        return json.loads(line)

    def run(self, prompt: list[int], new: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "new": new}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def text_prompts(model_dir: Path, path: Path, count: int) -> list[list[int]]:
    """`count` prompts of PROMPT_LEN tokens from `path`, spread evenly through it, each
    starting at the beginning of a line (code completions where the file is code)."""
    from lmops.runtime.tokenizer import load_tokenizer

    text = path.read_text(encoding="utf-8")
    tokenizer = load_tokenizer(model_dir)
    prompts = []
    for k in range(count):
        start = text.find("\n", k * len(text) // count) + 1
        ids = tokenizer.encode(text[start : start + 8 * PROMPT_LEN], add_special_tokens=False).ids
        if len(ids) < PROMPT_LEN:
            raise SystemExit(f"{path}: too little text after offset {start} for a {PROMPT_LEN}-token prompt")
        prompts.append(ids[:PROMPT_LEN])
    return prompts


def checkout(rev: str, into: Path) -> Path:
    """`src/` of `rev`, unpacked under `into` (git state untouched)."""
    data = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(data.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def vs_ctranslate2(row: dict) -> dict:
    """Each lmops engine of a thread count's `row` against CTranslate2's best backend there
    (the higher median decode tok/s): the ratio of medians, and the median, lowest and highest
    of the per-request ratios (each run paired with that backend's run of the same request)."""
    ct2 = [n for n in engines(row) if is_ctranslate2(n)]
    best = max(ct2, key=lambda n: row[n]["decode_tok_s"], default=None)
    if best is None:
        return {}
    out = {"best": best}
    for name in (n for n in engines(row) if n not in ct2):
        pairs = zip(row[name]["runs"], row[best]["runs"], strict=True)
        ratios = [x["decode_tok_s"] / y["decode_tok_s"] for x, y in pairs]
        out[name] = {
            "ratio_of_medians": row[name]["decode_tok_s"] / row[best]["decode_tok_s"],
            "per_request": [statistics.median(ratios), min(ratios), max(ratios)],
        }
    return out


def table(r: dict) -> str:
    lines = [
        "| threads | engine | decode tok/s (wall) | vs baseline | decode tok/s (CPU time) | vs baseline "
        "| vs CTranslate2's best (per request: median, range) | TTFT ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t, row in r["by_threads"].items():
        base, ct2 = row["baseline"], row.get("vs_ctranslate2", {})
        for name in engines(row):
            x = row[name]
            vs = "best" if name == ct2.get("best") else "-"
            if name in ct2:
                mid, lo, hi = ct2[name]["per_request"]
                vs = f"{ct2[name]['ratio_of_medians']:.2f}x ({mid:.2f}x, {lo:.2f}x-{hi:.2f}x)"
            label = f"{name} (acceptance {x['acceptance']:.0%})" if "acceptance" in x else name
            lines.append(
                f"| {t} | {label} | {x['decode_tok_s']:.0f} | {x['decode_tok_s'] / base['decode_tok_s']:.2f}x "
                f"| {x['decode_cpu_tok_s']:.0f} | {x['decode_cpu_tok_s'] / base['decode_cpu_tok_s']:.2f}x "
                f"| {vs} | {x['ttft_ms']:.1f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default=BASELINE, help=f"git revision to compare with (default {BASELINE})")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--speculative", type=int, default=0, help="also the engine with this many draft tokens")
    ap.add_argument(
        "--scheduler-steps",
        type=int,
        help="also the engine with num_scheduler_steps of this many steps (1: one step a call)",
    )
    ap.add_argument(
        "--draft-model",
        metavar="target|tiny|DIR",
        help="with --speculative: also an engine drafting from a draft model (the target itself, a tiny "
        "random one, or a model directory with the target's tokenizer)",
    )
    ap.add_argument(
        "--model", type=Path, help="a trained model directory (an export) instead of the random one"
    )
    ap.add_argument(
        "--prompts-from",
        type=Path,
        help="a text file (such as the corpus's test split) to take --num-prompts prompts from, "
        "each starting at a line, instead of the one synthetic prompt",
    )
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument(
        "--ctranslate2",
        action="store_true",
        help="also CTranslate2 fp32 on the same model (benchmarks/requirements.txt)",
    )
    ap.add_argument(
        "--sampling",
        nargs="+",
        default=[],
        metavar="FIELD=VALUE",
        help="SamplingParams fields of every lmops request (temperature=0.8 top_p=0.95): "
        "sampled instead of greedy",
    )
    ap.add_argument(
        "--int8",
        action="store_true",
        help="int8 weights: every lmops engine with quantization=int8, CTranslate2 with its int8 compute type",
    )
    ap.add_argument(
        "--malloc",
        nargs="+",
        choices=MALLOCS,
        default=["glibc"],
        help="the allocator every worker runs under (default glibc); each further one runs the "
        "engine as it is and CTranslate2 again under it, as now@NAME and ctranslate2-...@NAME",
    )
    ap.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="submit each request this many times at once: batched decode steps (lmops engines only)",
    )
    ap.add_argument("--quick", action="store_true", help="2 rounds, 1 thread")
    ap.add_argument("--out", type=Path, default=RESULTS / "single-stream-cpu.json")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--draft-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--ctranslate2-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--sampling-json", type=json.loads, default={}, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker and args.ctranslate2_dir:
        return ctranslate2_worker(
            args.ctranslate2_dir, args.worker, args.threads[0], args.sampling_json, args.int8
        )
    if args.worker:
        return worker(
            args.worker,
            args.threads[0],
            args.speculative,
            args.draft_dir,
            args.scheduler_steps,
            args.sampling_json,
            args.int8,
            args.concurrency,
        )
    if args.draft_model and not args.speculative:
        ap.error("--draft-model drafts --speculative K tokens a step: give K")
    if args.draft_model not in (None, "target", "tiny") and not Path(args.draft_model).is_dir():
        ap.error(f"--draft-model {args.draft_model}: not target, tiny or a model directory")
    if args.concurrency < 1 or (args.concurrency > 1 and args.ctranslate2):
        ap.error("--concurrency takes a count >= 1, of lmops engines' requests only (not with --ctranslate2)")
    try:
        sampling = {k: json.loads(v) for k, v in (field.split("=", 1) for field in args.sampling)}
    except ValueError:
        ap.error(f"--sampling takes FIELD=VALUE pairs with JSON values (top_p=0.95), not {args.sampling}")
    if args.quick:
        args.rounds, args.threads = 2, [1]
    new = 128
    res: dict = {
        "baseline": args.baseline,
        "rounds": args.rounds,
        "prompt_tokens": PROMPT_LEN,
        "new_tokens": new,
        "draft_model": args.draft_model,
        "scheduler_steps": args.scheduler_steps,
        "sampling": sampling or "greedy",
        "concurrency": args.concurrency,
        "malloc": args.malloc,
        "weights": "int8" if args.int8 else "float32",
        "cpu": cpu_description(),
        "model": str(args.model) if args.model else "random, default size",
        "prompts_from": str(args.prompts_from) if args.prompts_from else None,
    }
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        # Llama's layout: the baseline commit predates Qwen3's (model.qk_norm), and QK-norm
        # costs a decode step nothing measurable (benchmarks/README.md, "Architecture ablations").
        model_dir = args.model or build_random_model(Path(tmp) / "model", 1024, qk_norm=False)
        prompts = (
            text_prompts(model_dir, args.prompts_from, args.num_prompts)
            if args.prompts_from
            else [[3 + (7 * i) % 4000 for i in range(PROMPT_LEN)]]
        )
        # name -> what its Worker differs in from the engine as it is (REPO's src, the first --malloc)
        malloc, *more = args.malloc
        sources: dict[str, dict] = {
            "baseline": {"src": checkout(args.baseline, Path(tmp) / "baseline")},
            "now": {},
        }
        if args.scheduler_steps is not None:
            sources["scheduler-steps"] = {"steps": args.scheduler_steps}
        if args.speculative:
            sources["speculative"] = {"speculative": args.speculative}
        if args.draft_model:
            if args.draft_model == "tiny":
                draft_dir = build_random_model(Path(tmp) / "draft", 1024, seed=1, **TINY_SHAPE, qk_norm=False)
            else:
                draft_dir = model_dir if args.draft_model == "target" else Path(args.draft_model)
            sources["speculative-draft"] = {"speculative": args.speculative, "draft_dir": draft_dir}
        if args.ctranslate2:
            ct2_dir = convert_to_ctranslate2(model_dir, Path(tmp) / "ct2")
            for name, use_mkl in CT2_BACKENDS.items():
                sources[name] = {"ct2_dir": ct2_dir, "use_mkl": use_mkl}
        for other in more:
            sources[f"now@{other}"] = {"malloc": other}
            if args.ctranslate2:
                for name, use_mkl in CT2_BACKENDS.items():
                    sources[f"{name}@{other}"] = {"ct2_dir": ct2_dir, "use_mkl": use_mkl, "malloc": other}
        res["by_threads"] = {}
        common = {
            "src": REPO / "src",
            "malloc": malloc,
            "sampling": sampling,
            "int8": args.int8,
            "concurrency": args.concurrency,
        }
        for threads in args.threads:
            workers = {name: Worker(model_dir, threads, **(common | spec)) for name, spec in sources.items()}
            runs: dict[str, list[dict]] = {name: [] for name in workers}
            for _ in range(args.rounds):
                for k, prompt in enumerate(prompts):
                    for name, w in workers.items():
                        time.sleep(IDLE_BEFORE_REQUEST)
                        runs[name].append(w.run(prompt, new) | {"prompt": k})
            for w in workers.values():
                w.close()
            # int8: each library its own quantization, so CTranslate2's tokens are its own.
            compared = [r for name, r in runs.items() if not (args.int8 and is_ctranslate2(name))]
            for k in range(len(prompts) if not sampling else 0):
                tokens = [x["tokens"] for r in compared for x in r if x["prompt"] == k]
                assert all(t == tokens[0] for t in tokens), f"the engines' greedy tokens differ on prompt {k}"
            for r in runs.values():
                for x in r:
                    del x["tokens"]
            row: dict = {"compiled": {n: w.hello["compiled"] for n, w in workers.items()}}
            for name, r in runs.items():
                medians = {key: statistics.median(x[key] for x in r) for key in r[0] if key != "prompt"}
                row[name] = medians | {"runs": r}
            row["vs_ctranslate2"] = vs_ctranslate2(row)
            res["by_threads"][str(threads)] = row
    res["load_average_before_after"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    print(table(res))
    write_results(res, args.out)
    return res


if __name__ == "__main__":
    main()
