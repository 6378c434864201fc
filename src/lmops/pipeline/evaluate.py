"""Test-split evaluation: loss, perplexity, bits per byte, sample completions.

Bits per byte is the number comparable across tokenizers (and with character
models such as nanoGPT's): total negative log-likelihood in bits divided by the
UTF-8 bytes of the predicted tokens. The text is encoded with the model
directory's own tokenizer, so any model (a champion trained on other data
included) can be measured on the same test split.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from lmops import atomic
from lmops.errors import LmopsError
from lmops.pipeline import tracking
from lmops.pipeline.params import EvaluateConfig, Params
from lmops.pipeline.paths import METRICS_FILE, MODEL_DIR, PROCESSED_DIR, SAMPLES_FILE
from lmops.pipeline.tokenize_stage import split_path, text_chunks
from lmops.runtime.engine import LLMEngine, SamplingParams
from lmops.runtime.model import Llama, resolve_device
from lmops.runtime.model_dir import require_meta
from lmops.runtime.tokenizer import encode_pieces, load_tokenizer, token_byte_lengths

log = logging.getLogger(__name__)


@torch.no_grad()
def score(model: Llama, tokenizer, pieces: Iterable[str], cfg: EvaluateConfig) -> dict:
    """NLL over non-overlapping max_seq_len windows of the text in `pieces` (as `chunks`
    cuts it; at most max_batches batches of windows), encoded only as far as they reach."""
    if isinstance(pieces, str):  # a str iterates as characters: each would be encoded alone
        raise TypeError("score takes the text's pieces (lmops.runtime.tokenizer.chunks), not a str")
    needed = cfg.max_batches * cfg.batch_size * model.config.max_seq_len + 1
    ids = encode_pieces(tokenizer, pieces, at_least=needed)
    if len(ids) < 2:
        raise LmopsError("test split encodes to fewer than 2 tokens; nothing to evaluate")
    # Not always the context: a text too short to fill one is a single shorter window.
    window_len = min(model.config.max_seq_len, len(ids) - 1)
    n_windows = min((len(ids) - 1) // window_len, cfg.max_batches * cfg.batch_size)
    byte_len = token_byte_lengths(tokenizer)
    device = next(model.parameters()).device
    nll, n_tokens, n_bytes = 0.0, 0, 0
    for start in range(0, n_windows, cfg.batch_size):
        rows = range(start, min(start + cfg.batch_size, n_windows))
        windows = [ids[i * window_len : (i + 1) * window_len + 1] for i in rows]
        xy = torch.from_numpy(np.stack(windows)).to(device)
        logits, _ = model(xy[:, :-1])
        targets = xy[:, 1:]
        nll += F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum").item()
        n_tokens += targets.numel()
        n_bytes += int(byte_len[targets.cpu().numpy()].sum())
    loss = nll / n_tokens
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "bits_per_byte": nll / math.log(2) / max(n_bytes, 1),
        "tokens": n_tokens,
        "bytes": n_bytes,
    }


def evaluate_dir(model_dir: Path, test_path: Path, cfg: EvaluateConfig, device: str = "auto") -> dict:
    model = Llama.from_pretrained(model_dir, device=resolve_device(device))
    return score(model, load_tokenizer(model_dir), split_pieces(test_path), cfg)


def read_test_split(data_dir: Path = PROCESSED_DIR) -> tuple[Path, str]:
    """The test split's path and its sha256 (what makes two measurements comparable)."""
    path = split_path(data_dir, "test")
    with open(path, "rb") as fh:
        return path, hashlib.file_digest(fh, "sha256").hexdigest()


def split_pieces(path: Path) -> Iterator[str]:
    """The split's text as `chunks` cuts it, read as it is consumed."""
    return (piece for _, piece in text_chunks(path))


def sample_completions(
    engine: LLMEngine, prompts: list[str], sampling: SamplingParams
) -> list[tuple[str, str]]:
    """(prompt, completion) pairs from the inference engine."""
    outs = engine.generate(list(prompts), sampling)
    return [(prompt, out.text) for prompt, out in zip(prompts, outs, strict=True)]


def evaluate(params: Params, model_dir: Path = MODEL_DIR, data_dir: Path = PROCESSED_DIR) -> dict:
    cfg = params.evaluate
    meta = require_meta(model_dir)
    if meta.run_id:  # a tracking store that is down stops the stage before it writes anything
        tracking.configure(params.mlflow)
    test_path, test_sha = read_test_split(data_dir)
    # One load: the engine's model also scores the test split.
    # A handful of samples does not repay compiling the decode step (engine/compiled.py).
    engine = LLMEngine.from_pretrained(
        model_dir, device=params.train.device, max_num_seqs=len(cfg.prompts), compile=False
    )
    result = score(engine.model, engine.tokenizer, split_pieces(test_path), cfg)
    metrics = {f"test_{k}": v for k, v in result.items()}
    metrics["val_loss"] = meta.metrics.get("val_loss")
    metrics["test_split_sha256"] = test_sha

    # The model's own sampling defaults, as `lmops generate`, the pyfunc and the API use them,
    # seeded so that the stage's output is reproducible.
    s = SamplingParams.from_model_dir(model_dir, max_tokens=cfg.max_new_tokens, seed=cfg.seed)
    samples = sample_completions(engine, cfg.prompts, s)
    lines = [
        f"# Samples (temperature {s.temperature}, top_k {s.top_k}, top_p {s.top_p}, "
        f"seed {s.seed}, run {meta.run_id})",
        "",
    ]
    # Python highlighting for the default corpus only: the samples read like the corpus.
    fence = "```python" if params.data.source == "python-stdlib" else "```text"
    for prompt, completion in samples:
        lines += [f"## `{prompt}`", "", fence, prompt + completion, "```", ""]
    atomic.write_text(SAMPLES_FILE, "\n".join(lines))
    atomic.write_json(METRICS_FILE, metrics)

    if meta.run_id:
        # The test numbers only: val_loss is training's, and logging it again would add a
        # stray point at step 0 to its curve.
        numeric = {k: v for k, v in metrics.items() if k.startswith("test_") and isinstance(v, int | float)}
        with tracking.store_errors(tracking.tracking_uri(params.mlflow)):
            tracking.log_metrics(meta.run_id, numeric)
            tracking.client().log_artifact(meta.run_id, str(SAMPLES_FILE))
            tracking.client().log_artifact(meta.run_id, str(METRICS_FILE))
    log.info(
        "test: loss %.4f, ppl %.2f, %.4f bits/byte",
        result["loss"],
        result["perplexity"],
        result["bits_per_byte"],
    )
    return metrics
