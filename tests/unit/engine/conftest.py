"""A tiny random Llama model directory, built once per test session.

Weights are drawn wider than the training init (std 0.15 instead of 0.02) so that
next-token logits are well separated (greedy parity is then a sharp test, not a coin
flip on float noise) and attention visibly changes them (see test_fixture_is_sensitive).
"""

from __future__ import annotations

import random

import pytest
import torch

from lmops.pipeline.random_model import random_model_dir
from lmops.runtime.model import Llama
from lmops.runtime.model_config import TINY_SHAPE

MAX_LEN = 256


def synthetic_corpus(n_lines: int = 1500, seed: int = 0) -> list[str]:
    """Python-like lines plus some multi-byte UTF-8, deterministic."""
    rng = random.Random(seed)
    names = [
        "add",
        "total",
        "value",
        "items",
        "count",
        "result",
        "name",
        "data",
        "index",
        "café",
        "naïve",
        "größe",
        "日本",
        "snow☃",
    ]
    ops = ["+", "-", "*", "//", "%", "==", "<", ">="]
    lines = []
    for _ in range(n_lines):
        a, b, c = rng.choice(names), rng.choice(names), rng.choice(names)
        kind = rng.randrange(4)
        if kind == 0:
            lines.append(f"def {a}_{b}({c}, {a}):\n    return {c} {rng.choice(ops)} {a}\n")
        elif kind == 1:
            lines.append(f"for {a} in range({rng.randrange(100)}):\n    {b} += {a}\n")
        elif kind == 2:
            lines.append(f"# {a} {b} — {c} {rng.randrange(1000)}\n")
        else:
            lines.append(f'if {a} {rng.choice(ops)} {b}:\n    print("{c}")\n')
    return lines


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Tiny models run faster on one thread, and much faster when other jobs share the CPU."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-model")
    return random_model_dir(d, synthetic_corpus(), 512, MAX_LEN, seed=0, init_std=0.15, **TINY_SHAPE)


@pytest.fixture(scope="session")
def ref_model(model_dir):
    return Llama.from_pretrained(model_dir, "cpu", torch.float32)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from lmops.runtime.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def prompts(tokenizer):
    """16 prompts of mixed lengths (4 to ~120 tokens)."""
    lines = synthetic_corpus(400, seed=1)
    out = []
    for i in range(16):
        text = "".join(lines[i * 20 : i * 20 + 1 + (i * 7) % 20])
        ids = tokenizer.encode(text, add_special_tokens=False).ids[: 4 + i * 8]
        out.append(ids)
    return out


@torch.no_grad()
def _greedy_reference(model: Llama, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Full recompute: the whole sequence through the model for every new token."""
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        logits, _ = model(torch.tensor([ids], device=model.lm_head.weight.device))
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


def _assert_all_blocks_free(engine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not engine.requests and not engine.scheduler.has_work()


@pytest.fixture(scope="session")
def greedy_reference():
    """f(model, prompt_ids, max_tokens) -> greedy token ids by full recompute."""
    return _greedy_reference


@pytest.fixture(scope="session")
def all_blocks_free():
    """f(engine): asserts every KV block is back in the free pool and nothing is queued."""
    return _assert_all_blocks_free
