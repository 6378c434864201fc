"""`lmops` entry point: one subcommand per pipeline stage, plus params, trainjob, generate, bench, serve and links.

Every user-fixable problem is an `LmopsError`: printed as one line, exit code 1,
no traceback. Stages run from the repository root (paths are relative to it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from lmops.errors import LmopsError
from lmops.pipeline.params import PARAMS_FILE, load_params, update_params

log = logging.getLogger("lmops")
STAGES = ("get_data", "split", "tokenize", "train", "evaluate", "promote")


def _run_stage(name: str, args: argparse.Namespace) -> None:
    params = load_params(args.params)
    if name == "get_data":
        from lmops.pipeline.data import get_data

        get_data(params.data, slice_by=params.promote.slice_by)
    elif name == "split":
        from lmops.pipeline.data import split

        split(params.split, params.model.max_seq_len)
    elif name == "tokenize":
        _tokenize(params, args)
    elif name == "train":
        from lmops.pipeline.train import train

        train(params)
    elif name == "evaluate":
        from lmops.pipeline.evaluate import evaluate

        evaluate(params)
    elif name == "promote":
        from lmops.pipeline.promote import promote

        promote(params, force=args.force)


def _tokenize(params, args: argparse.Namespace) -> None:
    """The whole stage, or one of its steps for jobs that encode parts of it in parallel
    (the Kubeflow pipeline): the tokenizer alone, part K of N, then the merge of the parts."""
    from lmops.pipeline import tokenize_stage as ts
    from lmops.pipeline.paths import PROCESSED_DIR, TOKENIZER_DIR, TOKENS_DIR
    from lmops.runtime.tokenizer import load_tokenizer

    cfg = params.tokenizer
    if args.tokenizer_only:
        ts.train_and_save(cfg, params.model.max_seq_len, PROCESSED_DIR, TOKENIZER_DIR)
    elif args.part:
        k, _, n = args.part.partition("/")
        if not (k.isdigit() and n.isdigit() and int(k) < int(n)):
            raise LmopsError(f"tokenize --part {args.part}: expected K/N with 0 <= K < N")
        ts.encode_splits(load_tokenizer(TOKENIZER_DIR), cfg, PROCESSED_DIR, TOKENS_DIR, int(k), int(n))
    elif args.merge:
        parts = sorted(p for p in args.merge.iterdir() if p.is_dir())
        if not parts:
            raise LmopsError(f"tokenize --merge {args.merge}: no part directories there")
        ts.merge(parts, TOKENS_DIR)
    else:
        ts.tokenize(cfg, params.model.max_seq_len)


def _sampling(args: argparse.Namespace):
    """The model's own sampling defaults (generation_config.json), the flags given on top."""
    from lmops.runtime.engine import SamplingParams

    given = {k: getattr(args, k) for k in ("max_tokens", "temperature", "top_k", "top_p", "seed")}
    return SamplingParams.from_model_dir(args.model, **{k: v for k, v in given.items() if v is not None})


def _engine(args: argparse.Namespace, **settings):
    """The engine on `--model`: EngineConfig's defaults, `--device`, `--quantization` and `settings` on top."""
    from lmops.runtime.engine import LLMEngine

    if args.device is not None:
        settings["device"] = args.device
    if args.quantization is not None:
        settings["quantization"] = args.quantization
    return LLMEngine.from_pretrained(args.model, **settings)


def _generate(args: argparse.Namespace) -> None:
    """Stream one completion to stdout as the engine produces it."""
    sampling = _sampling(args)
    engine = _engine(args, max_num_seqs=1)
    try:
        engine.add_request("cli", args.prompt, sampling)
    except ValueError as exc:
        raise LmopsError(str(exc)) from None
    print(args.prompt, end="", flush=True)
    finished = None
    while finished is None:
        for out in engine.step():
            print(out.outputs[0].delta_text, end="", flush=True)
            finished = out if out.finished else None
    print()
    m = finished.metrics
    log.info(
        "%d tokens, TTFT %.1f ms, %.1f tokens/s, finish: %s",
        m.num_generation_tokens,
        1000 * m.ttft,
        m.num_generation_tokens / max(m.e2e_latency, 1e-9),
        finished.outputs[0].finish_reason,
    )


def _bench(args: argparse.Namespace) -> None:
    """Quick engine throughput on a model directory: N concurrent requests, one table."""
    import statistics

    engine = _engine(args)
    sampling = _sampling(args)
    prompts = [f"def function_{i}(x):\n    " for i in range(args.requests)]
    engine.generate(prompts[:1], sampling)  # warm-up
    started = time.perf_counter()
    outs = engine.generate(prompts, sampling)
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = sorted(1000 * o.metrics.ttft for o in outs)
    print(
        f"requests {len(outs)}  output tokens {tokens}  wall {elapsed:.2f} s  "
        f"throughput {tokens / elapsed:.0f} tok/s  TTFT p50 {statistics.median(ttft):.0f} ms  "
        f"p95 {ttft[int(0.95 * (len(ttft) - 1))]:.0f} ms"
    )


def _serve(args: argparse.Namespace) -> None:
    """Replace this process with the service (`python -m production_service.server`, which
    becomes gunicorn): the pipeline does not import the service."""
    os.environ.setdefault("LMOPS_MODEL_DIR", str(args.model.resolve()))
    os.execv(sys.executable, [sys.executable, "-m", "production_service.server"])


def _trainjob(args: argparse.Namespace) -> None:
    from lmops.pipeline.trainjob import launch

    launch(args.manifest, args.image, args.workspace, args.namespace, args.timeout, args.poll, args.dry_run)


def _links(args: argparse.Namespace) -> None:
    from lmops.pipeline.ui_links import ui_links

    for what, url in ui_links(load_params(args.params), args.url):
        print(f"{what}:\n  {url}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmops", description=__doc__.splitlines()[0])
    parser.add_argument("--params", default=PARAMS_FILE, help="params file (default: %(default)s)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for stage in STAGES:
        p = sub.add_parser(stage, help=f"run the {stage} stage alone")
        if stage == "promote":
            p.add_argument("--force", action="store_true", help="promote even if the champion is better")
        if stage == "tokenize":
            step = p.add_mutually_exclusive_group()
            step.add_argument(
                "--tokenizer-only", action="store_true", help="train and save the tokenizer only"
            )
            step.add_argument("--part", metavar="K/N", help="encode part K of N of every split (0-based)")
            step.add_argument("--merge", type=Path, metavar="DIR", help="join the part directories in DIR")
    change = sub.add_parser("params", help="set params.yaml keys, checked (a Kubeflow sweep's steps)")
    change.add_argument(
        "--update",
        required=True,
        metavar="JSON",
        help="dotted keys and values, e.g. '{\"train.muon_lr\": 0.01}'",
    )
    job = sub.add_parser(
        "trainjob", help="the train stage as a Kubeflow Trainer v2 TrainJob (the KFP pipeline's train step)"
    )
    job.add_argument("--image", required=True, help="the pipeline image the TrainJob's pods run")
    job.add_argument(
        "--manifest",
        type=Path,
        default=Path("kubeflow/trainjob.yaml"),
        help="the TrainJob to run, patched per run (default: %(default)s)",
    )
    job.add_argument(
        "--workspace",
        type=Path,
        default=Path("/workspace"),
        help="the shared volume, mounted where the runtime's pods mount it (default: %(default)s)",
    )
    job.add_argument("--namespace", help="default: the pod's own, else the kubeconfig context's")
    job.add_argument("--timeout", type=int, help="seconds (default: the TrainJob's activeDeadlineSeconds)")
    job.add_argument("--poll", type=float, default=10.0, help="seconds between status reads")
    job.add_argument("--dry-run", action="store_true", help="print the TrainJob; touch no cluster")
    gen = sub.add_parser("generate", help="stream a completion from a model directory (the engine)")
    gen.add_argument("--prompt", required=True)
    bench = sub.add_parser("bench", help="engine throughput on a model directory (full suite: benchmarks/)")
    bench.add_argument("--requests", type=int, default=32)
    for p in (gen, bench):
        p.add_argument("--model", type=Path, default=Path("production_service/model"))
        for flag, kind in (
            ("--max-tokens", int),
            ("--temperature", float),
            ("--top-k", int),
            ("--top-p", float),
            ("--seed", int),
        ):
            p.add_argument(flag, type=kind, help="default: the model's generation_config.json")
        p.add_argument("--device", help="auto (default: CUDA when present), cpu, cuda, cuda:N")
        p.add_argument("--quantization", choices=["int8"], help="int8: weight-only int8 (default: none)")
    srv = sub.add_parser("serve", help="run the inference service (gunicorn) on a model directory")
    srv.add_argument("--model", type=Path, default=Path("production_service/model"))
    links = sub.add_parser(
        "links", help="MLflow UI links: the experiment, its newest run, the registered model"
    )
    links.add_argument(
        "--url", default="http://127.0.0.1:5000", help="the UI's address (default: %(default)s)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("alembic", "mlflow", "urllib3", "httpx", "git"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # MLflow draws a "Downloading artifacts" bar for every model it copies (a few small
    # files, done in milliseconds): noise on a terminal, redraws in a log file.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    started = time.perf_counter()
    try:
        if args.command in STAGES:
            _run_stage(args.command, args)
        elif args.command == "params":
            try:
                updates = json.loads(args.update)
            except json.JSONDecodeError as exc:
                raise LmopsError(f"--update {args.update}: not JSON ({exc})") from None
            update_params(args.params, updates)
        elif args.command == "trainjob":
            _trainjob(args)
        elif args.command == "generate":
            _generate(args)
        elif args.command == "bench":
            _bench(args)
        elif args.command == "serve":
            _serve(args)
        elif args.command == "links":
            _links(args)
    except LmopsError as exc:
        print(f"lmops {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"lmops {args.command}: interrupted", file=sys.stderr)
        return 130
    if args.command in STAGES:
        log.info("%s done in %.1f s", args.command, time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
