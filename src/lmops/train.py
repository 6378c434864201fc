"""Training loop: AdamW, warmup + cosine LR, grad accumulation and clipping,
bf16 autocast on CUDA, DDP under torchrun, checkpoints and exact resume.

Determinism is by construction: the batch of (step, micro-step, rank) is drawn
from an RNG seeded with exactly those numbers, so "data position" is just the
step counter, and a run killed at any point and resumed from its last
checkpoint replays the same batches and ends with the same weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from lmops import atomic, tracking
from lmops.config import Params, TrainConfig
from lmops.errors import LmopsError
from lmops.model import MODEL_FILES, Llama, LlamaConfig, resolve_device
from lmops.paths import CHECKPOINT_DIR, MANIFEST_FILE, MODEL_DIR, PROCESSED_DIR, TOKENIZER_DIR, TRAIN_LOG_FILE
from lmops.tokenize import read_tokens

log = logging.getLogger(__name__)

LOG_COLUMNS = ("step", "tokens", "train_loss", "val_loss", "lr", "tokens_per_sec", "mfu")
# Fault injection for the resume test: SIGKILL ourselves right after this step.
FAULT_ENV = "LMOPS_FAULT_SIGKILL_AFTER_STEP"


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(device: torch.device) -> Dist:
    if "RANK" not in os.environ:
        return Dist()
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return Dist(dist.get_rank(), dist.get_world_size())


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to learning_rate, then cosine decay to min_lr at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (cfg.learning_rate - cfg.min_lr)


def batch(
    tokens: np.ndarray, block: int, size: int, seed: tuple[int, ...], device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`size` random windows of `block` tokens and their next-token targets."""
    if len(tokens) <= block + 1:
        raise LmopsError(f"split has {len(tokens)} tokens, fewer than model.max_seq_len + 2 = {block + 2}")
    starts = np.random.default_rng(seed).integers(0, len(tokens) - block - 1, size)
    rows = np.stack([tokens[s : s + block + 1].astype(np.int64) for s in starts])
    xy = torch.from_numpy(rows).to(device)
    return xy[:, :-1], xy[:, 1:]


def measure_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Dense matmul FLOP/s on this device: the denominator of our MFU estimate."""
    n = 4096 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    a @ a  # warm-up
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.3:
        a @ a
        reps += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def fingerprint(params: Params, world: int, train_bin: Path) -> str:
    """What a checkpoint must match to be resumed: config, world size and the exact data."""
    h = hashlib.sha256(
        json.dumps(
            {"model": params.model.model_dump(), "train": params.train.model_dump(), "world": world},
            sort_keys=True,
        ).encode()
    )
    h.update(hashlib.sha256(train_bin.read_bytes()).digest())
    return h.hexdigest()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_checkpoint(ckpt_dir: Path, model: Llama, opt: torch.optim.Optimizer, state: dict) -> None:
    with atomic.directory(ckpt_dir) as tmp:
        weights = {
            k: v.detach().cpu().contiguous()
            for k, v in model.state_dict().items()
            if not (model.config.tie_embeddings and k == "lm_head.weight")
        }
        save_file(weights, str(tmp / "model.safetensors"))
        opt_state = opt.state_dict()
        tensors = {"rng.torch": torch.get_rng_state()}
        for idx, slots in opt_state["state"].items():
            for name, value in slots.items():
                tensors[f"optim.{idx}.{name}"] = value.detach().cpu().contiguous()
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        state = {
            **state,
            "param_groups": opt_state["param_groups"],
            "sha256": {f: _sha256(tmp / f) for f in ("model.safetensors", "optimizer.safetensors")},
        }
        (tmp / "state.json").write_text(json.dumps(state, indent=1))


def load_checkpoint(ckpt_dir: Path, model: Llama, opt: torch.optim.Optimizer) -> dict:
    """Restore weights, optimizer and RNG; a damaged checkpoint is an error, never ignored."""
    hint = f"delete {ckpt_dir} to train from scratch"
    try:
        state = json.loads((ckpt_dir / "state.json").read_text())
        for name, digest in state["sha256"].items():
            if _sha256(ckpt_dir / name) != digest:
                raise LmopsError(
                    f"checkpoint {ckpt_dir}: {name} is corrupt or truncated (sha256 mismatch); {hint}"
                )
        weights = load_file(str(ckpt_dir / "model.safetensors"))
        tensors = load_file(str(ckpt_dir / "optimizer.safetensors"))
    except LmopsError:
        raise
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        raise LmopsError(f"checkpoint {ckpt_dir} is unreadable ({exc}); {hint}") from None
    if model.config.tie_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    device = next(model.parameters()).device
    model.load_state_dict({k: v.to(device) for k, v in weights.items()})
    slots: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, idx, name = key.split(".", 2)
            slots.setdefault(int(idx), {})[name] = value if name == "step" else value.to(device)
    opt.load_state_dict({"state": slots, "param_groups": state["param_groups"]})
    torch.set_rng_state(tensors["rng.torch"])
    return state


def make_optimizer(model: Llama, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms), as in nanoGPT."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda"
    )


@torch.no_grad()
def estimate_val_loss(model, tokens, cfg: TrainConfig, block: int, device, autocast) -> float:
    """Mean loss on a fixed set of validation windows (the same ones every time)."""
    model.eval()
    losses = []
    for i in range(cfg.eval_batches):
        x, y = batch(tokens, block, cfg.batch_size, (cfg.seed, 2**31 - 1, i), device)
        with autocast:
            losses.append(model(x, y)[1].item())
    model.train()
    return float(np.mean(losses))


def write_log(rows: list[dict], path: Path = TRAIN_LOG_FILE) -> None:
    lines = [",".join(LOG_COLUMNS)]
    lines += [",".join("" if r.get(c) is None else f"{r[c]:.6g}" for c in LOG_COLUMNS) for r in rows]
    atomic.write_text(path, "\n".join(lines) + "\n")


def export_model(model: Llama, directory: Path, meta: dict) -> None:
    """The HF Llama model directory, written atomically."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (TOKENIZER_DIR / name).is_file():
            raise LmopsError(f"{TOKENIZER_DIR / name} not found: run `lmops tokenize` first")
    with atomic.directory(directory) as tmp:
        model.save_pretrained(tmp)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (tmp / name).write_bytes((TOKENIZER_DIR / name).read_bytes())
        (tmp / "lmops.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        missing = [f for f in MODEL_FILES if not (tmp / f).is_file()]
        assert not missing, missing


def train(
    params: Params, data_dir: Path = PROCESSED_DIR, out_dir: Path = MODEL_DIR, ckpt_dir: Path = CHECKPOINT_DIR
) -> dict:
    cfg, mcfg = params.train, params.model
    device = resolve_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    ddp = setup_distributed(device)
    try:
        return _train(params, cfg, mcfg, device, ddp, data_dir, out_dir, ckpt_dir)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(params, cfg, mcfg, device, ddp, data_dir, out_dir, ckpt_dir) -> dict:
    stats_path = TOKENIZER_DIR / "stats.json"
    if not stats_path.is_file():
        raise LmopsError(f"{stats_path} not found: run `lmops tokenize` first")
    vocab_size = json.loads(stats_path.read_text())["vocab_size"]
    train_tokens = read_tokens(data_dir / "train.bin", vocab_size)
    val_tokens = read_tokens(data_dir / "val.bin", vocab_size)
    manifest = json.loads(MANIFEST_FILE.read_text()) if MANIFEST_FILE.is_file() else {}

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model_cfg = LlamaConfig(vocab_size=vocab_size, **mcfg.model_dump())
    model = Llama(model_cfg).to(device)
    opt = make_optimizer(model, cfg, device)
    if not ddp.main:
        log.setLevel(logging.WARNING)  # one rank reports progress

    fp = fingerprint(params, ddp.world, data_dir / "train.bin")
    start_step, history, run_id, tokens_seen = 0, [], None, 0
    if (ckpt_dir / "state.json").is_file():
        state = json.loads((ckpt_dir / "state.json").read_text())
        if state.get("fingerprint") == fp:
            state = load_checkpoint(ckpt_dir, model, opt)
            start_step, history, run_id = state["step"], state["history"], state.get("run_id")
            tokens_seen = state["tokens"]
            log.info("resuming from %s at step %d", ckpt_dir, start_step)
        else:
            log.info("ignoring checkpoint in %s: made with other params or data", ckpt_dir)

    raw_model = model
    if ddp.world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    )
    peak = measure_peak_flops(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    flops_per_token = raw_model.flops_per_token()
    tokens_per_step = cfg.batch_size * mcfg.max_seq_len * cfg.grad_accum_steps * ddp.world

    run = None
    if ddp.main:
        run = tracking.start_training_run(params, run_id, manifest.get("sha256"))
        run_id = run.info.run_id
        tracking.log_params_once(
            params,
            run_id,
            extra={"num_params": raw_model.num_params(), "world_size": ddp.world, "device": device.type},
        )
        tracking.log_data_report(run_id)
    fault_step = int(os.environ.get(FAULT_ENV, "-1"))

    model.train()
    bar = tqdm(
        range(start_step, cfg.max_steps),
        initial=start_step,
        total=cfg.max_steps,
        desc="train",
        unit="step",
        disable=not ddp.main,
        dynamic_ncols=True,
    )
    t_last, tokens_last = time.perf_counter(), tokens_seen
    for step in bar:
        lr = lr_at(step, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        loss_sum = 0.0
        for micro in range(cfg.grad_accum_steps):
            x, y = batch(
                train_tokens, mcfg.max_seq_len, cfg.batch_size, (cfg.seed, step, micro, ddp.rank), device
            )
            sync = micro == cfg.grad_accum_steps - 1 or ddp.world == 1
            with contextlib.nullcontext() if sync else model.no_sync(), autocast:
                _, loss = model(x, y)
            (loss / cfg.grad_accum_steps).backward()
            loss_sum += loss.item()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens_seen += tokens_per_step
        done = step + 1

        row = None
        if done % cfg.log_interval == 0 or done == cfg.max_steps or done % cfg.eval_interval == 0:
            now = time.perf_counter()
            tps = (tokens_seen - tokens_last) / max(now - t_last, 1e-9)
            t_last, tokens_last = now, tokens_seen
            row = {
                "step": done,
                "tokens": tokens_seen,
                "train_loss": loss_sum / cfg.grad_accum_steps,
                "lr": lr,
                "tokens_per_sec": tps,
                "mfu": tps * flops_per_token / peak / ddp.world,
            }
            bar.set_postfix(loss=f"{row['train_loss']:.3f}", tok_s=f"{tps:,.0f}")
        if done % cfg.eval_interval == 0 or done == cfg.max_steps:
            row["val_loss"] = estimate_val_loss(
                raw_model, val_tokens, cfg, mcfg.max_seq_len, device, autocast
            )
            log.info("step %d: train %.4f val %.4f", done, row["train_loss"], row["val_loss"])
        if row is not None and ddp.main:
            history.append(row)
            tracking.log_step(run_id, row)
        if ddp.main and (done % cfg.checkpoint_interval == 0 or done == cfg.max_steps):
            save_checkpoint(
                ckpt_dir,
                raw_model,
                opt,
                {
                    "step": done,
                    "fingerprint": fp,
                    "history": history,
                    "run_id": run_id,
                    "tokens": tokens_seen,
                },
            )
            write_log(history)
        if done == fault_step:
            os.kill(os.getpid(), signal.SIGKILL)
    bar.close()

    if not ddp.main:
        return {}
    final = history[-1] if history else {}
    meta = {
        "run_id": run_id,
        "data_sha256": manifest.get("sha256"),
        "git_commit": tracking.git_commit(),
        "metrics": {
            "train_loss": final.get("train_loss"),
            "val_loss": final.get("val_loss"),
            "steps": cfg.max_steps,
            "tokens": tokens_seen,
        },
        "num_params": raw_model.num_params(),
    }
    export_model(raw_model, out_dir, meta)
    write_log(history)
    tracking.log_model(run_id, out_dir)
    tracking.end_run(run_id)
    log.info("model written to %s (run %s)", out_dir, run_id)
    return meta
