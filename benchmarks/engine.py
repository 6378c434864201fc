"""Engine benchmark: lmops' LLMEngine against transformers' generate() on the same weights.

    python benchmarks/engine.py [--model DIR] [--quick] [--device auto|cpu|cuda] [--ctranslate2]

Without --model it builds a randomly initialised model of the default size (vocab 4096,
4 layers, 6 heads, 2 KV heads, 192 wide, MLP 512) with max_position_embeddings 1024,
since workloads B and C need 640 and 528 tokens of context (the training default of 256
would not hold them). With --model, prompts are shortened to fit that model's context.

Workloads (issue 3):
  A  1 request, 128-token prompt, 128 new tokens: decode tokens/s vs HF generate (KV cache),
     with the eager and the compiled decode path (engine/compiled.py) taking turns.
  B  64 requests, prompts 16-512 tokens, 128 new tokens: output tokens/s vs HF one by one
     and vs HF in left-padded static batches of 16 (and with --ctranslate2, CPU only, vs
     CTranslate2's generate_batch in fp32 and int8, counting the requests whose greedy
     tokens equal ours).
  C  32 requests sharing a 512-token prefix + 16 own tokens: median TTFT, prefix caching
     on vs off (all submitted at once).
  D  during B: KV memory in allocated blocks / memory that real tokens occupy.
Plus, for A: one decode step against the floor of reading every weight once from memory,
and a profile of where the step's time goes.

Greedy decoding with EOS ignored everywhere, so both sides generate exactly the same
number of tokens. Prints a table; writes benchmarks/results/engine-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from lmops.pipeline.random_model import random_model_dir
from lmops.runtime.engine import LLMEngine, SamplingParams
from lmops.runtime.engine.config import EngineConfig
from lmops.runtime.model import default_dtype, resolve_device

RESULTS = Path(__file__).resolve().parent / "results"
SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def write_results(result: dict, out: Path) -> None:
    """Write one benchmark's JSON result (under benchmarks/results/ unless --out says otherwise)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)


def cpu_description() -> str:
    """The CPU's model and the vector extensions that set its speed here, e.g. "AMD EPYC
    (AVX2 only)": the same benchmark runs at very different rates on AVX-512/BF16 and AVX2."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    flags = set(re.search(r"^flags\s*:\s*(.+)$", info, re.M).group(1).split()) if "flags" in info else set()
    found = [
        name
        for flag, name in (("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX"))
        if flag in flags
    ]
    extensions = ", ".join(found) if found else "AVX2 only" if "avx2" in flags else "no AVX2"
    return f"{model.group(1).strip() if model else platform.processor()} ({extensions})"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_random_model(directory: Path, max_len: int, seed: int = 0, **shape) -> Path:
    """The default-size model (or `shape`) with random weights, plus a 4096-token BPE to
    decode its output (the same BPE whatever the seed or shape)."""
    if SHAKESPEARE.is_file():
        text = SHAKESPEARE.read_text(encoding="utf-8")
        texts = [text[i : i + 65536] for i in range(0, len(text), 65536)]
    else:  # any text will do: the tokenizer only has to cover the ids the model emits
        rng = random.Random(0)
        words = [
            "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
            for _ in range(20000)
        ]
        texts = [" ".join(rng.choice(words) for _ in range(5000)) for _ in range(60)]
    return random_model_dir(directory, texts, 4096, max_len, seed=seed, **shape)


class HF:
    """transformers' generate (its stock class for the directory: Llama, or Qwen3 with QK-norm),
    greedy, exactly `new` tokens."""

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.device = device

    @torch.inference_mode()
    def generate(self, batch: list[list[int]], new: int) -> float:
        """Seconds for one generate() call over `batch` (left-padded when lengths differ)."""
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        sync(self.device)
        t = time.perf_counter()
        out = self.model.generate(
            ids.to(self.device),
            attention_mask=mask.to(self.device),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
        sync(self.device)
        assert out.shape[1] == width + new
        return time.perf_counter() - t


def convert_to_ctranslate2(model_dir: Path, out: Path) -> Path:
    """The model in CTranslate2's format (fp32 weights; int8 is chosen at load), by
    CTranslate2's own Transformers converter."""
    try:
        from ctranslate2.converters import TransformersConverter
    except ImportError:
        raise SystemExit(
            "--ctranslate2 needs CTranslate2: pip install -r benchmarks/requirements.txt"
        ) from None
    TransformersConverter(str(model_dir)).convert(str(out), force=True)
    return out


class CT2:
    """CTranslate2's Generator on the CPU, exactly `new` tokens (EOS ignored): greedy, or
    `stream`'s sampling."""

    def __init__(self, ct2_dir: Path, model_dir: Path, compute_type: str, threads: int):
        import ctranslate2

        from lmops.runtime.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(model_dir)
        self.generator = ctranslate2.Generator(
            str(ct2_dir), device="cpu", compute_type=compute_type, intra_threads=threads
        )

    def stream(self, prompt: list[int], new: int, sampling: dict | None = None) -> Iterator[int]:
        """One request through `generate_tokens`: its tokens, as they come. Greedy, or
        sampled with `sampling`'s temperature, top_k and top_p (SamplingParams' names and
        meanings: top_k 0 is no limit, as CTranslate2's sampling_topk 0)."""
        prompt_tokens = [self.tokenizer.id_to_token(i) for i in prompt]
        knobs = {"sampling_topk": 1}
        if sampling:
            if unknown := set(sampling) - {"temperature", "top_k", "top_p", "seed"}:
                raise SystemExit(f"CTranslate2's worker: no SamplingParams field {sorted(unknown)} there")
            if "seed" in sampling:
                import ctranslate2

                ctranslate2.set_random_seed(sampling["seed"])
            knobs = {
                "sampling_temperature": sampling.get("temperature", 1.0),
                "sampling_topk": max(sampling.get("top_k", 0), 0),
                "sampling_topp": sampling.get("top_p", 1.0),
            }
        for step in self.generator.generate_tokens(prompt_tokens, max_length=new, end_token=[], **knobs):
            yield step.token_id

    def generate(self, batch: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
        """Seconds for one generate_batch() over all of `batch`, and its new tokens."""
        prompts = [[self.tokenizer.id_to_token(i) for i in p] for p in batch]
        t = time.perf_counter()
        results = self.generator.generate_batch(
            prompts,
            max_length=new,
            min_length=new,
            sampling_topk=1,
            end_token=[],
            include_prompt_in_result=False,
        )
        seconds = time.perf_counter() - t
        return seconds, [r.sequences_ids[0] for r in results]


def make_engine(model_dir: Path, device: str, **kw) -> LLMEngine:
    engine = LLMEngine.from_pretrained(model_dir, device=device, **kw)
    engine.generate([[5] * 20], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    return engine


def greedy(new: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)


# -- workloads ----------------------------------------------------------------------------


def workload_a(engines: dict[str, LLMEngine], hf: HF, prompt_len: int, new: int, repeats: int) -> dict:
    """Each engine (eager, compiled) and HF take turns, `repeats` times; medians."""
    rng = random.Random(1)
    vocab = next(iter(engines.values())).model_config.vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
    ours: dict[str, list[float]] = {name: [] for name in engines}
    theirs = []
    for _ in range(repeats):
        for name, engine in engines.items():
            m = engine.generate([prompt], greedy(new))[0].metrics
            ours[name].append((new - 1) / (m.last_token_time - m.first_token_time))
        t_first = hf.generate([prompt], 1)
        t_all = hf.generate([prompt], new)
        theirs.append((new - 1) / (t_all - t_first))
    hf_tps = statistics.median(theirs)
    out = {"prompt_tokens": prompt_len, "new_tokens": new, "hf_decode_tok_s": hf_tps, "prompt": prompt}
    for name, runs in ours.items():
        tps = statistics.median(runs)
        out[name] = {"decode_tok_s": tps, "speedup": tps / hf_tps, "step_ms": 1000 / tps, "runs": runs}
    out["targets"] = {"speedup": 3.0, "compiled_step_ms": 1.2}
    return out


def workload_b(
    engine: LLMEngine,
    hf: HF,
    n_req: int,
    lo: int,
    hi: int,
    new: int,
    hf_one_by_one: int,
    rounds: int,
    ct2: dict[str, CT2] | None = None,
) -> dict:
    rng = random.Random(2)
    V = engine.model_config.vocab_size
    prompts = [[rng.randrange(3, V) for _ in range(rng.randint(lo, hi))] for _ in range(n_req)]
    alloc: list[int] = []
    real: list[int] = []
    bm, bs = engine.block_manager, engine.block_size
    step = engine.step

    def measured_step():  # D: after every step, blocks in use vs tokens whose K/V they hold
        out = step()
        held = sum(s.num_computed_tokens for s in engine.scheduler.running)
        if held:
            alloc.append(bm.num_used_blocks * bs)
            real.append(held)
        return out

    engine.step = measured_step
    # Ours and HF's padded batches alternate for `rounds` rounds (medians), so that load from
    # other jobs on a shared machine falls on both alike.
    # CTranslate2 (--ctranslate2) takes its turn in each round too, the whole batch at once.
    ours, padded = [], []
    ct2_rounds: dict[str, list[float]] = {name: [] for name in ct2 or {}}
    agree: dict[str, int] = {}
    for _ in range(rounds):
        t = time.perf_counter()
        outs = engine.generate(prompts, greedy(new))
        sync(engine.device)
        ours.append(n_req * new / (time.perf_counter() - t))
        assert all(len(o.token_ids) == new for o in outs)
        t_pad = sum(hf.generate(prompts[i : i + 16], new) for i in range(0, n_req, 16))
        padded.append(n_req * new / t_pad)
        for name, generator in (ct2 or {}).items():
            seconds, tokens = generator.generate(prompts, new)
            assert all(len(t) == new for t in tokens)
            ct2_rounds[name].append(n_req * new / seconds)
            agree[name] = sum(t == o.token_ids for t, o in zip(tokens, outs, strict=True))
    ours_tps, hf_pad = statistics.median(ours), statistics.median(padded)
    peak_i = max(range(len(alloc)), key=lambda i: real[i])
    # HF one request at a time, once (it is slow; --quick: only the first few, per token).
    k = min(hf_one_by_one, n_req)
    t_seq = sum(hf.generate([p], new) for p in prompts[:k])
    hf_seq = k * new / t_seq
    return {
        "requests": n_req,
        "prompt_tokens": [lo, hi],
        "new_tokens": new,
        "rounds": rounds,
        "engine_tok_s": ours_tps,
        "engine_tok_s_rounds": ours,
        "hf_padded16_tok_s_rounds": padded,
        "hf_one_by_one_tok_s": hf_seq,
        "hf_one_by_one_sampled": k,
        "hf_padded16_tok_s": hf_pad,
        "speedup_vs_one_by_one": ours_tps / hf_seq,
        "speedup_vs_padded16": ours_tps / hf_pad,
        "targets": [8.0, 2.0],
        "ctranslate2": {
            name: {
                "tok_s": statistics.median(r),
                "tok_s_rounds": r,
                "engine_over_ct2": ours_tps / statistics.median(r),
                "greedy_same_as_engine": f"{agree[name]}/{n_req}",
            }
            for name, r in ct2_rounds.items()
        },
        "kv_waste": {
            "allocated_over_real": sum(alloc) / sum(real),
            "at_peak_allocated_over_real": alloc[peak_i] / real[peak_i],
            "peak_real_tokens": real[peak_i],
            "pool_blocks": bm.num_blocks,
            "block_size": bs,
            "steps_sampled": len(alloc),
            "target": 1.05,
        },
    }


def workload_c(model_dir: Path, device: str, n_req: int, prefix_len: int, own: int, new: int) -> dict:
    rng = random.Random(3)
    V = 4096
    prefix = [rng.randrange(3, V) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randrange(3, V) for _ in range(own)] for _ in range(n_req)]
    out = {}
    for caching in (True, False):
        # Without the drift signal: a prompt it scores is prefilled whole, past the cached
        # prefix (its cost on this workload is benchmarks/drift.py's `prefix`).
        engine = make_engine(model_dir, device, enable_prefix_caching=caching, compile=False, drift_sample=0)
        outs = engine.generate(prompts, greedy(new))
        ttfts = [o.metrics.ttft for o in outs]
        out["on" if caching else "off"] = {
            "median_ttft_s": statistics.median(ttfts),
            "max_ttft_s": max(ttfts),
            "prefix_hit_tokens": engine.metrics.registry.get_sample_value("lmops:prefix_cache_hits_total"),
        }
    out.update(
        requests=n_req,
        prefix_tokens=prefix_len,
        own_tokens=own,
        new_tokens=new,
        target=5.0,
        ttft_ratio=out["off"]["median_ttft_s"] / out["on"]["median_ttft_s"],
    )
    return out


def decode_steps(engine: LLMEngine, prompt: list[int], steps: int) -> dict:
    """engine.step() of one decoding request, alternating the compiled and the eager path
    step by step, so that load from other jobs falls on both alike (min, p10, median ms).
    One step a call on both (num_scheduler_steps 1 for the duration): the eager path has no
    multi-step runs, and a run of the compiled one is not a step."""
    decode, scheduler = engine.runner.decode, engine.scheduler
    runs, scheduler.num_scheduler_steps = scheduler.num_scheduler_steps, 1
    engine.add_request("alternating", prompt, greedy(steps + 2))
    engine.step()  # prefill
    times: dict[str, list[float]] = {"compiled": [], "eager": []}
    for i in range(steps):
        name = "compiled" if i % 2 == 0 else "eager"
        engine.runner.decode = decode if name == "compiled" else None
        t = time.perf_counter()
        engine.step()
        sync(engine.device)
        times[name].append(1000 * (time.perf_counter() - t))
    engine.runner.decode, scheduler.num_scheduler_steps = decode, runs
    engine.abort("alternating")
    out = {}
    for name, ms in times.items():
        ms.sort()
        out[name] = {"min_ms": ms[0], "p10_ms": ms[len(ms) // 10], "median_ms": statistics.median(ms)}
    out["steps"] = steps
    return out


def bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a tensor copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def decode_floor(engine: LLMEngine, prompt: list[int], step_ms: float) -> dict:
    """One decode step vs reading all weights once; where the step's time goes (profiler)."""
    from torch.profiler import ProfilerActivity, profile

    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    dram = bandwidth(engine.device, 1 << 30)
    cache = bandwidth(engine.device, 8 << 20)
    engine.add_request("profiled", prompt, greedy(64))
    for _ in range(8):  # prefill, then some decodes
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    sync(engine.device)
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(10):
            engine.step()
        sync(engine.device)
        wall = (time.perf_counter() - t) / 10
    engine.abort("profiled")
    groups = {
        "matmul (projections, MLP, lm_head)": (
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "aten::matmul",
            "aten::linear",
        ),
        "attention (SDPA)": ("aten::_scaled_dot_product", "aten::scaled_dot_product"),
        "KV writes and block gathers": ("aten::index_copy", "aten::index_select"),
        "elementwise (RMSNorm, RoPE, SiLU, residual)": (
            "aten::mul",
            "aten::add",
            "aten::rsqrt",
            "aten::pow",
            "aten::mean",
            "aten::silu",
            "aten::cat",
            "aten::neg",
            "aten::cos",
            "aten::sin",
            "aten::to",
            "aten::_to_copy",
            "aten::copy_",
            "aten::embedding",
            "aten::slice",
            "aten::chunk",
        ),
        "sampling (argmax etc.)": ("aten::argmax", "aten::topk", "aten::softmax", "aten::_log_softmax"),
    }
    totals = dict.fromkeys(groups, 0.0)
    top = []
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    op_total = 0.0
    for e in events:
        us = e.self_cpu_time_total / 10
        op_total += us
        for g, prefixes in groups.items():
            if e.key.startswith(prefixes):
                totals[g] += us
                break
        if len(top) < 12:
            top.append({"op": e.key, "self_ms_per_step": us / 1000, "calls_per_step": e.count / 10})
    breakdown = {g: v / 1000 for g, v in totals.items()}
    breakdown["other aten ops"] = (op_total - sum(totals.values())) / 1000
    breakdown["python / framework overhead (wall - aten self time)"] = max(0.0, wall * 1000 - op_total / 1000)
    return {
        "weight_bytes": weight_bytes,
        "dram_bandwidth_gb_s": dram / 1e9,
        "cache_bandwidth_gb_s_8mib": cache / 1e9,
        "floor_ms_dram": weight_bytes / dram * 1000,
        "floor_ms_cache": weight_bytes / cache * 1000,
        "decode_step_ms": step_ms,
        "profiled_step_ms": wall * 1000,
        "breakdown_ms_per_step": breakdown,
        "top_ops": top,
    }


# -- report -------------------------------------------------------------------------------


def table(r: dict) -> str:
    a, b, c = r["A"], r["B"], r["C"]
    d = b["kv_waste"]
    rows = [
        (
            f"A: decode tok/s, 1 req, {name}",
            f"{a[name]['decode_tok_s']:.0f} ({a[name]['step_ms']:.2f} ms/step)",
            f"{a['hf_decode_tok_s']:.0f} (HF generate)",
            f"{a[name]['speedup']:.2f}x",
            ">= 3x" + (", <= 1.2 ms" if name == "compiled" else ""),
        )
        for name in ("eager", "compiled")
        if name in a
    ] + [
        (
            "B: output tok/s, vs HF 1-by-1",
            f"{b['engine_tok_s']:.0f}",
            f"{b['hf_one_by_one_tok_s']:.0f}",
            f"{b['speedup_vs_one_by_one']:.2f}x",
            ">= 8x",
        ),
        (
            "B: output tok/s, vs HF padded x16",
            f"{b['engine_tok_s']:.0f}",
            f"{b['hf_padded16_tok_s']:.0f}",
            f"{b['speedup_vs_padded16']:.2f}x",
            ">= 2x",
        ),
        *(
            (
                f"B: output tok/s, vs CTranslate2 {name}",
                f"{b['engine_tok_s']:.0f}",
                f"{x['tok_s']:.0f} (same greedy {x['greedy_same_as_engine']})",
                f"{x['engine_over_ct2']:.2f}x",
                "> 1x",
            )
            for name, x in b["ctranslate2"].items()
        ),
        (
            "C: median TTFT, prefix cache on/off",
            f"{c['on']['median_ttft_s'] * 1000:.0f} ms",
            f"{c['off']['median_ttft_s'] * 1000:.0f} ms (off)",
            f"{c['ttft_ratio']:.1f}x lower",
            ">= 5x",
        ),
        (
            "D: KV allocated / real tokens",
            f"{d['allocated_over_real']:.3f}",
            f"at peak {d['at_peak_allocated_over_real']:.3f}",
            "",
            "<= 1.05",
        ),
    ]
    w = [
        max(len(x[i]) for x in rows + [("workload", "lmops", "baseline", "ratio", "target")])
        for i in range(5)
    ]
    line = lambda x: "| " + " | ".join(s.ljust(w[i]) for i, s in enumerate(x)) + " |"  # noqa: E731
    out = [
        line(("workload", "lmops", "baseline", "ratio", "target")),
        "|" + "|".join("-" * (n + 2) for n in w) + "|",
    ] + [line(x) for x in rows]
    f = r["floor"]
    out += [
        "",
        f"compiled decode: batch sizes {r['compile']['batch_sizes']} compiled at engine start in "
        f"{r['compile']['seconds']:.1f} s; load average before/after {r['load_average_before_after']}",
        *(
            [
                "decode step alternating compiled / eager (ms, min / p10 / median): "
                + " vs ".join(
                    "{min_ms:.2f} / {p10_ms:.2f} / {median_ms:.2f}".format(**r["decode_steps"][k])
                    for k in ("compiled", "eager")
                )
            ]
            if "decode_steps" in r
            else []
        ),
        f"A eager decode step: {f['decode_step_ms']:.2f} ms (profiled {f['profiled_step_ms']:.2f} ms); "
        f"weights {f['weight_bytes'] / 2**20:.1f} MiB; floor {f['floor_ms_dram']:.3f} ms at "
        f"{f['dram_bandwidth_gb_s']:.1f} GB/s (1 GiB copy), {f['floor_ms_cache']:.3f} ms at "
        f"{f['cache_bandwidth_gb_s_8mib']:.1f} GB/s (8 MiB copy, cache-resident)",
        "where a decode step goes (ms):",
    ]
    out += [f"  {k:<55} {v:7.3f}" for k, v in f["breakdown_ms_per_step"].items()]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="model directory (default: random model of the default size)")
    ap.add_argument("--device", default=EngineConfig.device, help="for both sides (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="short run: fewer requests and tokens")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads for both sides (default 1: on a shared machine two OpenMP "
        "threads on two cores stall whenever another process runs, HF more than us)",
    )
    ap.add_argument(
        "--hf-one-by-one",
        type=int,
        default=None,
        help="how many of B's requests HF runs one at a time (default: all; --quick: 4)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="B: alternating rounds of lmops and HF padded batches; medians reported",
    )
    ap.add_argument(
        "--ctranslate2",
        action="store_true",
        help="B: also CTranslate2 fp32 and int8 on the same model, CPU (benchmarks/requirements.txt)",
    )
    ap.add_argument("--out", type=Path, help="JSON path (default results/engine-<device>.json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = default_dtype(device)
    tmp = None
    if args.model is None:
        tmp = tempfile.TemporaryDirectory()
        model_dir = build_random_model(Path(tmp.name), 1024)
        source = "random init, default size, max_position_embeddings=1024 (B needs 640, C 528 tokens)"
    else:
        model_dir, source = args.model, str(args.model)
    q = args.quick
    new = 32 if q else 128
    # A: the eager and the compiled decode path side by side (compile=True regardless of
    # LMOPS_COMPILE); B serves with the default (compiled unless LMOPS_COMPILE=0); C measures
    # prefill TTFT, which compiling does not change, so its engines skip the compile.
    engine = make_engine(model_dir, args.device, compile=False)
    t = time.perf_counter()
    compiled = make_engine(model_dir, args.device, compile=True)
    compile_s = time.perf_counter() - t
    ctx = engine.max_model_len
    hi = min(512, ctx - new)
    hf = HF(model_dir, device, dtype)
    hf.generate([[5] * 20], 2)  # warm-up
    print(
        f"model: {source}; {sum(p.numel() for p in engine.model.parameters()) / 1e6:.2f}M params; "
        f"device {device} {dtype}; threads {torch.get_num_threads()}; context {ctx}",
        file=sys.stderr,
    )
    res = {
        "model": source,
        "device": str(device),
        "dtype": str(dtype),
        "quick": q,
        "threads": torch.get_num_threads(),
        "cpu": cpu_description(),
        "torch": torch.__version__,
    }
    load_before = os.getloadavg()  # 1-minute averages: was anything else running?
    decode = compiled.runner.decode
    res["compile"] = {
        "batch_sizes": decode.sizes if decode else [],
        "seconds": decode.compile_seconds if decode else 0.0,
        "engine_start_s": compile_s,
        "inductor_cache_dir": os.environ.get(
            "TORCHINDUCTOR_CACHE_DIR", "default (/tmp/torchinductor_<user>)"
        ),
    }
    engines = {"eager": engine, "compiled": compiled} if decode else {"eager": engine}
    res["A"] = workload_a(engines, hf, min(128, ctx - new), new, repeats=2 if q else 3)
    n_b = 16 if q else 64
    one_by_one = args.hf_one_by_one or (4 if q else n_b)
    b_engine = make_engine(model_dir, args.device)
    ct2 = None
    if args.ctranslate2:
        ct2_dir = convert_to_ctranslate2(model_dir, Path(tempfile.mkdtemp()) / "ct2")
        ct2 = {kind: CT2(ct2_dir, model_dir, kind, args.threads) for kind in ("float32", "int8")}
    res["B"] = workload_b(b_engine, hf, n_b, 16, hi, new, one_by_one, rounds=1 if q else args.rounds, ct2=ct2)
    res["B"]["compiled_decode"] = b_engine.runner.decode is not None
    res["C"] = workload_c(model_dir, args.device, 8 if q else 32, min(512, ctx - 16 - 16), 16, 16)
    if decode:
        res["decode_steps"] = decode_steps(compiled, res["A"]["prompt"], 100 if q else 400)
    res["floor"] = decode_floor(engine, res["A"].pop("prompt"), res["A"]["eager"]["step_ms"])
    res["load_average_before_after"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    print(table(res))
    write_results(res, args.out or RESULTS / f"engine-{device.type}{'-quick' if q else ''}.json")
    if tmp:
        tmp.cleanup()
    return res


if __name__ == "__main__":
    main()
