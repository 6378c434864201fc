"""Shared fixtures: tiny projects, tiny models, and a subprocess runner for the CLI."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from lmops.pipeline.params import BUILTIN_CHECKS
from lmops.runtime.model_config import TINY_SHAPE, LlamaConfig

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SHARED_DATA = REPO.parent / "shared" / "data"

# Engines decode eagerly in tests (compiling costs seconds per engine), here and in the
# subprocesses that inherit this environment; test_compiled.py turns it on where it is tested.
os.environ["LMOPS_COMPILE"] = "0"

# Small enough that a whole `dvc repro` takes seconds, big enough to exercise every stage.
TINY_PARAMS = {
    "data": {"source": "python-stdlib", "max_bytes": 400_000},
    "split": {"val_fraction": 0.1, "test_fraction": 0.1},
    "tokenizer": {"vocab_size": 400},
    "model": {**TINY_SHAPE, "max_seq_len": 64},
    "train": {
        "max_steps": 20,
        "batch_size": 8,
        "warmup_steps": 4,
        "eval_interval": 10,
        "eval_batches": 2,
        "checkpoint_interval": 10,
        "log_interval": 5,
        "threads": 1,
        "compile": False,  # compiling costs seconds per run; tests/integration/test_train_resume.py compiles
    },
    "evaluate": {"unit_bytes": 2048, "batch_size": 8, "max_new_tokens": 12},
    # Models of 4 to 20 steps all loop under greedy decoding: which loops less is noise, so
    # the repetition check (tests/unit/test_checks.py) is left out of the tiny pipeline.
    "promote": {"checks": [c for c in BUILTIN_CHECKS if c != "repetition"]},
}


def env() -> dict[str, str]:
    """The test environment for subprocesses: our venv first, tracking local to the project."""
    e = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    e["PATH"] = f"{BIN}{os.pathsep}{e.get('PATH', '')}"
    e["PYTHONUNBUFFERED"] = "1"
    e["OMP_NUM_THREADS"] = "1"
    return e


def run(
    cmd: list[str], cwd: Path, check: bool = True, timeout: float = 300, **kw
) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        cmd, cwd=cwd, env=kw.pop("env", env()), capture_output=True, text=True, timeout=timeout, **kw
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-4000:]}"
        )
    return proc


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_pull_restores(clone: Path, project: Path, dvc: str) -> None:
    """`dvc pull` in `clone` brings back the pipeline's outputs byte for byte."""
    run([dvc, "pull"], clone)
    for rel in (
        "artifacts/model/model.safetensors",
        "data/processed/test.txt",
        "artifacts/tokenizer/tokenizer.json",
    ):
        assert (clone / rel).read_bytes() == (project / rel).read_bytes()
    assert "up to date" in run([dvc, "status"], clone).stdout


def write_params(project: Path, overrides: dict, base: Path = REPO / "params.yaml") -> None:
    """params.yaml for `project`: `base` with `overrides` merged in, section by section."""
    params = yaml.safe_load(base.read_text())
    for section, values in overrides.items():
        params.setdefault(section, {}).update(values)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def make_project(root: Path, overrides: dict | None = None, git: bool = True) -> Path:
    """A fresh lmops working copy (pipeline definition + tiny params) in `root`."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "dvc.yaml", root / "dvc.yaml")
    shutil.copytree(REPO / ".dvc", root / ".dvc", ignore=shutil.ignore_patterns("tmp", "cache"))
    for name in (".gitignore", ".dvcignore"):
        shutil.copy(REPO / name, root / name)
    write_params(root, {**TINY_PARAMS, **(overrides or {})})
    if git:
        run(["git", "init", "-q"], root)
        run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "init", "--allow-empty"],
            root,
        )
        run(["git", "add", "-A"], root)
        run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "project"], root)
    return root


@pytest.fixture(scope="session")
def tokenized_project(tmp_path_factory) -> Path:
    """A project with get_data, split and tokenize done (read-only for tests: copy it)."""
    project = make_project(tmp_path_factory.mktemp("tokenized"), git=False)
    for stage in ("get_data", "split", "tokenize"):
        run([str(BIN / "lmops"), stage], project)
    return project


def make_tiny_model_dir(
    directory: Path,
    max_seq_len: int = 128,
    meta: dict | None = None,
    text: str | None = None,
    seed: int | None = None,
) -> Path:
    """A randomly initialised tiny Llama directory in the HF layout the pipeline exports
    (`seed` fixes its weights, for a test whose outcome depends on them)."""
    from lmops.pipeline.random_model import random_model_dir

    text = text or "\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400))
    return random_model_dir(directory, [text], 300, max_seq_len, seed=seed, meta=meta or {}, **TINY_SHAPE)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@dataclass(frozen=True)
class TrainedModel:
    """A tiny model that has learned something, with held-out text and its reference bits/byte."""

    path: Path
    test_text: str
    reference_bits_per_byte: float


def make_trained_model_dir(directory: Path, steps: int = 150, seed: int = 0) -> TrainedModel:
    """Train a tiny Llama for `steps` on standard-library sources (offline, ~10 s on one core):
    a model whose cross-entropy tells its own kind of text from others (the drift tests).
    Its lmops.json carries `metrics.test_bits_per_byte`, measured on the held-out files with
    evaluate.score, as promotion writes it."""
    import json

    import numpy as np
    import torch

    from lmops.pipeline.evaluate import score
    from lmops.pipeline.tokenize_stage import save_tokenizer, train_tokenizer
    from lmops.runtime.model import Llama
    from lmops.runtime.model_dir import ModelMeta, write_meta
    from lmops.runtime.tokenizer import chunks, encode

    files = sorted(p for p in Path(json.__file__).parents[1].glob("*.py") if p.stat().st_size < 60_000)
    texts = [p.read_text(errors="replace") for p in files[:40]]
    train_text = "\n".join(t for i, t in enumerate(texts) if i % 10)
    test_text = "\n".join(texts[::10])
    tok = train_tokenizer([train_text], vocab_size=512)
    ids = torch.from_numpy(encode(tok, train_text))
    torch.manual_seed(seed)
    shape = {**TINY_SHAPE, "n_embd": 96, "intermediate_size": 192}  # wide enough to learn in 150 steps
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), max_seq_len=256, **shape)
    model = Llama(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model trains faster on one thread, far faster on a busy CPU
    try:
        for _ in range(steps):
            starts = torch.from_numpy(rng.integers(0, len(ids) - 129, 16))
            xy = torch.stack([ids[s : s + 129] for s in starts])
            _, loss = model(xy[:, :-1], xy[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        ref = score(model, tok, chunks(test_text), batch_size=8)["bits_per_byte"]
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(directory)
    save_tokenizer(tok, directory, cfg.max_seq_len)
    metrics = {"test_bits_per_byte": ref}
    write_meta(directory, ModelMeta(run_id="run-trained", model_name="lmops-trained", metrics=metrics))
    return TrainedModel(directory, test_text, ref)


@pytest.fixture(scope="session")
def trained_model(tmp_path_factory) -> TrainedModel:
    return make_trained_model_dir(tmp_path_factory.mktemp("trained-model"))
