"""`lmops` entry point: one subcommand per pipeline stage, plus generate and serve.

Every user-fixable problem is an `LmopsError`: printed as one line, exit code 1,
no traceback. Stages run from the repository root (paths are relative to it).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from lmops.config import PARAMS_FILE, load_params
from lmops.errors import LmopsError

log = logging.getLogger("lmops")
STAGES = ("get_data", "split", "tokenize", "train", "evaluate", "promote")


def _run_stage(name: str, args: argparse.Namespace) -> None:
    params = load_params(args.params)
    if name == "get_data":
        from lmops.data import get_data

        get_data(params.data)
    elif name == "split":
        from lmops.data import split

        split(params.split)
    elif name == "tokenize":
        from lmops.tokenizer import tokenize

        tokenize(params.tokenizer, params.model.block_size)
    elif name == "train":
        from lmops.train import train

        train(params)
    elif name == "evaluate":
        from lmops.evaluate import evaluate

        evaluate(params)
    elif name == "promote":
        from lmops.promote import promote

        promote(params, force=args.force)


def _generate(args: argparse.Namespace) -> None:
    from lmops.generate import Sampling, complete_from_dir

    sampling = Sampling(args.max_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    for completion in complete_from_dir(args.model, [args.prompt], sampling, args.device):
        print(args.prompt + completion)


def _serve(args: argparse.Namespace) -> None:
    os.environ.setdefault("LMOPS_MODEL_DIR", str(args.model))
    os.execvp("gunicorn", ["gunicorn", "--config", "production_service/gunicorn.conf.py",
                           "production_service.app:create_app()"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmops", description=__doc__.splitlines()[0])
    parser.add_argument("--params", default=PARAMS_FILE, help="params file (default: %(default)s)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for stage in STAGES:
        p = sub.add_parser(stage, help=f"run the {stage} stage alone")
        if stage == "promote":
            p.add_argument("--force", action="store_true", help="promote even if the champion is better")
    gen = sub.add_parser("generate", help="sample a completion from a model directory")
    gen.add_argument("--model", type=Path, default=Path("production_service/model"))
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=50)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--seed", type=int, default=1337)
    gen.add_argument("--device", default="auto")
    srv = sub.add_parser("serve", help="run the inference service (gunicorn) on a model directory")
    srv.add_argument("--model", type=Path, default=Path("production_service/model"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("alembic", "mlflow", "urllib3", "httpx", "git"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    started = time.perf_counter()
    try:
        if args.command in STAGES:
            _run_stage(args.command, args)
        elif args.command == "generate":
            _generate(args)
        elif args.command == "serve":
            _serve(args)
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
