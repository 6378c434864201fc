"""Training speed: lmops' model against `transformers`' own class for its layout, step for step.

The default model of params.yaml (vocab 4096), params.yaml's batch (16 x 256 tokens),
the same AdamW (`lmops.pipeline.train.make_optimizer`: params.yaml's betas and weight decay),
gradient clipping at 1.0, the same threads, the same random batches. One loop times
every configuration: forward with the loss, backward, clip, optimizer step, zero grads.
The configurations alternate over `--rounds` (so background load hits each alike);
the median step counts. `transformers` computes its own loss from `labels` (one
position fewer per row than ours, 255 of 256: it flatters HF by 0.4%).

- precision: float32, or bfloat16 autocast (what `train.precision: auto` picks on CUDA
  and on CPUs with AVX512-BF16 or AMX; weights and optimizer state stay float32).
- compiled: `torch.compile` of the model, as `train.compile: true` does; its compile
  time (the first step) is reported apart.

MFU = tokens/s x training FLOPs per token (`Llama.flops_per_token`, PaLM's 6N + attention)
/ this machine's dense matmul FLOP/s in that precision (`lmops.pipeline.train.measure_peak_flops`).

    python benchmarks/train.py [--rounds 3] [--steps 5] [--threads 0] [--out results/train-cpu.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from engine import RESULTS, write_results

from lmops.pipeline.params import Params, parse_params
from lmops.pipeline.train import (
    WEIGHT_DECAY,
    autocast,
    batch,
    make_optimizer,
    measure_peak_flops,
    resolve_precision,
)
from lmops.runtime.model import Llama
from lmops.runtime.model_config import LlamaConfig

VOCAB = 4096
BASELINE = "transformers float32"
CONFIGS = {  # name: (library, precision, compiled, model overrides)
    BASELINE: ("transformers", torch.float32, False, {}),
    "transformers bfloat16": ("transformers", torch.bfloat16, False, {}),
    "transformers bfloat16 compiled": ("transformers", torch.bfloat16, True, {}),
    "lmops float32": ("lmops", torch.float32, False, {}),
    "lmops float32 compiled": ("lmops", torch.float32, True, {}),
    "lmops bfloat16": ("lmops", torch.bfloat16, False, {}),
    "lmops bfloat16 compiled": ("lmops", torch.bfloat16, True, {}),
    # What QK-norm (the default) costs a step against Llama's layout (issue 32: adopted only
    # where it wins at equal wall-clock).
    "lmops bfloat16 compiled, Llama layout": ("lmops", torch.bfloat16, True, {"qk_norm": False}),
}


class Trainer:
    """One configuration: its model, optimizer and step; models start from the same weights."""

    def __init__(
        self, library: str, precision: torch.dtype, compiled: bool, shape: dict, params: Params, state: dict
    ):
        cfg = LlamaConfig(vocab_size=VOCAB, **{**params.model.model_dump(), **shape})
        if library == "transformers":
            import transformers

            hf = transformers.AutoConfig.for_model(**cfg.to_hf())  # Llama's, or Qwen3's with QK-norm
            self.model = transformers.AutoModelForCausalLM.from_config(hf)
        else:
            self.model = Llama(cfg)
        # The same weights; the layouts differ by QK-norm's norms alone (kept at their init).
        loaded = self.model.load_state_dict(state, strict=False)
        differ = loaded.missing_keys + loaded.unexpected_keys
        assert all(k.endswith(("q_norm.weight", "k_norm.weight")) for k in differ), differ
        self.library, self.precision = library, precision
        self.opt = make_optimizer(self.model, params.train, torch.device("cpu"))
        self.forward = torch.compile(self.model) if compiled else self.model
        self.autocast = autocast(torch.device("cpu"), precision)
        self.step_seconds: list[float] = []
        self.compile_seconds: float | None = None

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.autocast:
            if self.library == "transformers":
                return self.forward(input_ids=x, labels=x).loss
            return self.forward(x, y)[1]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        started = time.perf_counter()
        self.loss(x, y).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration per round")
    parser.add_argument("--threads", type=int, default=0, help="torch threads, 0 = torch's default")
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=RESULTS / "train-cpu.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # The step's speed: the default shape, and auto's choices for the default corpus (no dropout).
    params = parse_params({"model": {"dropout": 0.0}, "train": {"weight_decay": WEIGHT_DECAY}})
    max_seq_len, size = params.model.max_seq_len, params.train.batch_size
    load_before = os.getloadavg()

    torch.manual_seed(0)
    reference = Llama(LlamaConfig(vocab_size=VOCAB, **params.model.model_dump()))
    trainers = {name: Trainer(*CONFIGS[name], params, reference.state_dict()) for name in args.configs}
    tokens = torch.randint(0, VOCAB, (1_000_000,)).numpy()
    batches = iter(range(10**9))

    def next_batch():
        return batch(tokens, max_seq_len, size, (0, next(batches)), "cpu")

    for trainer in trainers.values():  # first step: compiles (where compiled), then two warm-up steps
        trainer.compile_seconds = trainer.step(*next_batch())
        for _ in range(2):
            trainer.step(*next_batch())
    for _ in range(args.rounds):
        for trainer in trainers.values():
            trainer.step_seconds += [trainer.step(*next_batch()) for _ in range(args.steps)]

    flops_per_token = reference.flops_per_token()
    peaks = {
        dtype: measure_peak_flops(torch.device("cpu"), dtype)
        for dtype in {t.precision for t in trainers.values()}
    }
    rows = {}
    for name, trainer in trainers.items():
        step = statistics.median(trainer.step_seconds)
        tokens_per_sec = size * max_seq_len / step
        rows[name] = {
            "step_ms": round(step * 1000, 1),
            "tokens_per_sec": round(tokens_per_sec),
            "mfu": round(tokens_per_sec * flops_per_token / peaks[trainer.precision], 3),
            "first_step_s": round(trainer.compile_seconds, 1),
        }
    if BASELINE in rows:
        for row in rows.values():
            row["vs_transformers_fp32"] = round(row["tokens_per_sec"] / rows[BASELINE]["tokens_per_sec"], 2)
    result = {
        "benchmark": "train",
        "model": {"vocab_size": VOCAB, **params.model.model_dump()},
        "batch": [size, max_seq_len],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "bf16_native": resolve_precision("auto", torch.device("cpu")) == torch.bfloat16,
        "peak_flops": {str(d).removeprefix("torch."): round(p / 1e9, 1) for d, p in peaks.items()},
        "flops_per_token": flops_per_token,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "results": rows,
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }
    print(table(result))
    write_results(result, args.out)
    return result


def table(result: dict) -> str:
    peaks = ", ".join(f"{k} {v} GFLOP/s" for k, v in result["peak_flops"].items())
    lines = [
        f"batch {result['batch'][0]} x {result['batch'][1]}, {result['threads']} threads, "
        f"peak {peaks}, load average before/after {result['load_average_before_after']}",
        "| configuration | step ms | tokens/s | vs transformers fp32 | MFU | first step s |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in result["results"].items():
        ratio = f"{r['vs_transformers_fp32']}x" if "vs_transformers_fp32" in r else ""
        lines.append(
            f"| {name} | {r['step_ms']} | {r['tokens_per_sec']} | {ratio} | {r['mfu']:.1%} | {r['first_step_s']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
