"""Training loop: AdamW or Muon (`optim.py`), warmup then cosine, plateau or wsd LR, grad
accumulation and clipping, bf16 autocast where the hardware has it, a compiled step, DDP
under torchrun, checkpoints and exact resume.

Determinism is by construction: the windows of (step, micro-step, rank) are a pure
function of the seed and those numbers (`batch`: each epoch a seeded permutation of the
split's windows), so "data position" is just the step counter, and a run killed at any
point and resumed from its last checkpoint replays the same batches and ends with the
same weights (bit for bit on CPU, where torch's deterministic mode is on; on CUDA to
rounding, since its attention backward and cuBLAS accumulate in no fixed order).

Under the schedules whose learning rate does not depend on `max_steps` (plateau, and wsd
before its cooldown), a checkpoint also resumes under another `max_steps`: a longer run
passes through that very state. wsd keeps the checkpoint of its cooldown's first step
beside the last one, so a finished run is trained longer from there, into a new MLflow run.

The exported model is the best one seen, not the last (`train.keep_best`): the
lowest validation loss at any evaluation, whose weights ride along in every
checkpoint so resume picks the same step; `train.early_stopping_patience` ends
the run once validation has stopped improving.

A tracking server that stays down past MLflow's retries stops the run cleanly: a
checkpoint, then one line. `lmops train` again resumes into the same MLflow run, logs
the rows the server missed (no gap in the curves) and tags the run `resumed_at_steps`.

Structure: `_setup` builds a `Run` (everything the run works with) and its
`Progress` (what a checkpoint saves); `_loop` calls `_train_step`, `_evaluate`
and `_checkpoint`; `_finish` exports and closes the MLflow run.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from lmops import atomic, crash_points
from lmops.errors import LmopsError
from lmops.pipeline import tracking
from lmops.pipeline.checkpoint import fingerprint, load_checkpoint, load_weights, save_checkpoint, weights_of
from lmops.pipeline.optim import Optimizer, make_optimizer
from lmops.pipeline.params import AUTO, Params, TrainConfig, cooldown_steps, parse_params
from lmops.pipeline.paths import (
    CHECKPOINT_DIR,
    MANIFEST_FILE,
    MODEL_DIR,
    PROCESSED_DIR,
    TOKENIZER_DIR,
    TOKENS_DIR,
    TRAIN_LOG_FILE,
    VAL_LOG_FILE,
)
from lmops.pipeline.tokenize_stage import Tokens, check_tokenizer, read_tokens
from lmops.runtime.model import Llama, bf16_native, resolve_device
from lmops.runtime.model_config import LlamaConfig
from lmops.runtime.model_dir import ModelMeta, write_model_dir
from lmops.runtime.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

# Two files, so that every row of each is measured: training every log_interval steps,
# validation every eval_interval steps (one file with empty cells drew those as zeros).
LOG_COLUMNS = ("step", "tokens", "train_loss", "lr", "tokens_per_sec", "mfu")
VAL_COLUMNS = ("step", "tokens", "val_loss")


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def deterministic_kernels(device: torch.device) -> None:
    """On CPU, torch's deterministic mode. The compiled step's embedding backward is a
    scatter-add that inductor writes with atomics across threads, so two runs differ in
    the last bits and drift apart; in deterministic mode inductor calls ATen's ordered
    kernel instead (no measurable cost on CPU), which makes resume, and a longer run, exact."""
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True)


def setup_distributed(device: torch.device) -> Dist:
    if "RANK" not in os.environ:
        return Dist()
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return Dist(dist.get_rank(), dist.get_world_size())


def leave_distributed(run: Run) -> None:
    """Wait for every rank, then take the process group down in an order that cannot hang.

    Gloo's barrier holds weak references to the collectives before it (DDP's gradient
    all-reduces, the validation loss), so their tensors are freed with the barrier's work,
    and freeing a tensor Python has seen takes the GIL. Were that work freed last by a
    gloo worker thread, while this thread holds the GIL in the process group's destructor
    joining that worker, both would wait for ever. So this thread keeps the barrier's handle
    until the group is gone: DDP (whose reducer holds the group) first, then the group,
    whose workers it joins then have nothing left to free; the barrier is freed on return.
    """
    everyone_done = dist.barrier(async_op=True)
    everyone_done.wait()
    run.forward = run.model
    dist.destroy_process_group()


def lr_at(step: int, cfg: TrainConfig, plateau_decays: int = 0) -> float:
    """Linear warmup to learning_rate; then cosine decay to min_lr at max_steps, or (plateau)
    learning_rate * lr_plateau_factor ** plateau_decays, down to min_lr, or (wsd) learning_rate
    until the cooldown, whose steps fall linearly to min_lr, the last one at min_lr."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "plateau":
        return plateau_lr(cfg, plateau_decays)
    if cfg.lr_schedule == "wsd":
        start = cooldown_start(cfg.max_steps, cfg)
        cooled = min(1.0, max(0, step - start + 1) / max(1, cfg.max_steps - start))
        return cfg.learning_rate + cooled * (cfg.min_lr - cfg.learning_rate)
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (cfg.learning_rate - cfg.min_lr)


# `auto` follows the epochs a run makes over its train split (max_steps x tokens per step /
# train tokens), so one params.yaml suits a 1 MB corpus and a 1 GB one. Within FEW_EPOCHS
# validation falls to the end (the default corpus makes 1.04): no dropout, and wsd, whose
# constant phase lets the same run be trained longer (cosine for a run too short for wsd's
# warmup and cooldown). Past MANY_EPOCHS the model memorises
# (validation turns up after ~5 epochs on tiny Shakespeare): dropout on the residual branches
# (not on the attention weights, which costs 2.3x a CPU step), plateau, which cuts the rate
# whenever validation stalls, and a weight decay ten times the usual one (the data-constrained
# regime's, as in Kim et al. 2025, "Pre-training under infinite compute"). benchmarks/README.md,
# "The training recipe", has the measurements.
FEW_EPOCHS, MANY_EPOCHS = 2.0, 4.0
WEIGHT_DECAY, MANY_EPOCHS_WEIGHT_DECAY = 0.1, 1.0


def follow_the_data(params: Params, train_tokens: int, world: int = 1) -> tuple[Params, dict]:
    """`params` with every `auto` replaced by its choice for this much data, checked as params.yaml
    is (a wsd cooldown that does not fit names its key), and what was chosen, with the epochs."""
    cfg = params.train
    tokens = cfg.max_steps * cfg.batch_size * cfg.grad_accum_steps * world * params.model.max_seq_len
    epochs = tokens / max(1, train_tokens)
    chosen: dict[str, dict] = {"model": {}, "train": {}}
    if params.model.dropout == AUTO:
        chosen["model"]["dropout"] = 0.0 if epochs <= FEW_EPOCHS else 0.1 if epochs <= MANY_EPOCHS else 0.2
        if params.model.attention_dropout is None:
            chosen["model"]["attention_dropout"] = 0.0
    if cfg.lr_schedule == AUTO:
        fits = cfg.warmup_steps + cooldown_steps(cfg.max_steps, cfg.cooldown_fraction) <= cfg.max_steps
        chosen["train"]["lr_schedule"] = "plateau" if epochs > MANY_EPOCHS else "wsd" if fits else "cosine"
    if cfg.weight_decay == AUTO:
        chosen["train"]["weight_decay"] = MANY_EPOCHS_WEIGHT_DECAY if epochs > MANY_EPOCHS else WEIGHT_DECAY
    choices = {f"{section}.{key}": value for section, keys in chosen.items() for key, value in keys.items()}
    if not choices:
        return params, {"epochs": round(epochs, 3)}
    raw = params.model_dump()
    for section, keys in chosen.items():
        raw[section].update(keys)
    said = (
        f"auto chose {', '.join(f'{key} {value}' for key, value in choices.items())} for {epochs:.2f} epochs"
    )
    log.info("%d steps over %d train tokens: %s", cfg.max_steps, train_tokens, said)
    resolved = parse_params(raw, origin=f"params.yaml ({said})")
    return resolved, {"epochs": round(epochs, 3), **{f"auto.{key}": v for key, v in choices.items()}}


def cooldown_start(max_steps: int, cfg: TrainConfig) -> int:
    """wsd: the first step of the cooldown of a run of `max_steps` steps."""
    return max_steps - cooldown_steps(max_steps, cfg.cooldown_fraction)


def continues(cfg: TrainConfig, planned_steps: int, step: int) -> bool:
    """Whether the first `step` steps of a run planned for `planned_steps` are those of one
    planned for `cfg.max_steps`: the same learning rates, and neither run's final evaluation
    among them. Cosine stretches with max_steps; plateau never looks at it; wsd only from its
    cooldown on."""
    if planned_steps == cfg.max_steps:
        return True
    if cfg.lr_schedule == "cosine":
        return False
    plans = (planned_steps, cfg.max_steps)
    last = min(plans) - 1
    if cfg.lr_schedule == "wsd":
        last = min(last, *(cooldown_start(m, cfg) for m in plans))
    return step <= last


def plateau_lr(cfg: TrainConfig, decays: int) -> float:
    """The plateau schedule's rate after `decays` cuts."""
    return max(cfg.min_lr, cfg.learning_rate * cfg.lr_plateau_factor**decays)


def batch(
    tokens: Tokens | np.ndarray, max_seq_len: int, size: int, seed: int, first: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows `first` to `first + size - 1` of the run (`max_seq_len` tokens each) and their
    next-token targets. The run reads the split epoch by epoch without replacement: each
    epoch is a seeded permutation of its non-overlapping windows, cut from a seeded offset of
    its own, so every token is a target once an epoch (random starts saw some text several
    times and left a third of a one-epoch run's unseen: benchmarks/README.md, "The training
    recipe")."""
    if len(tokens) <= max_seq_len + 1:
        raise LmopsError(
            f"split has {len(tokens)} tokens, fewer than model.max_seq_len + 2 = {max_seq_len + 2}"
        )
    per_epoch = max(1, (len(tokens) - 1) // max_seq_len - 1)  # one spare: room for the offset
    slack = min(max_seq_len - 1, len(tokens) - 1 - per_epoch * max_seq_len)
    starts = []
    for g in range(first, first + size):
        epoch, k = divmod(g, per_epoch)
        offset, order = _epoch_windows(seed, epoch, per_epoch, slack)
        starts.append(offset + max_seq_len * int(order[k]))
    return windows(tokens, starts, max_seq_len, device)


def windows(
    tokens: Tokens | np.ndarray, starts, max_seq_len: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows of `max_seq_len` tokens at `starts`, and their next-token targets."""
    rows = np.stack([tokens[s : s + max_seq_len + 1].astype(np.int64) for s in starts])
    xy = torch.from_numpy(rows).to(device)
    return xy[:, :-1], xy[:, 1:]


@functools.lru_cache(maxsize=2)  # a batch spans at most two epochs
def _epoch_windows(seed: int, epoch: int, per_epoch: int, slack: int) -> tuple[int, np.ndarray]:
    """An epoch's offset (0 to `slack`) and the order of its `per_epoch` windows."""
    rng = np.random.default_rng((seed, epoch))
    return int(rng.integers(0, slack + 1)), rng.permutation(per_epoch)


def resolve_precision(name: str, device: torch.device) -> torch.dtype:
    """The autocast dtype of the matrix products. `auto` picks bfloat16 where they run
    natively in it (`bf16_native`), else float32. Weights, optimizer state and the loss
    stay float32."""
    if name == "auto":
        return torch.bfloat16 if bf16_native(device) else torch.float32
    return getattr(torch, name)


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Mixed precision for the forward pass (none for float32)."""
    return torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()


@dataclass
class PeakFlops:
    """The denominator of our MFU estimate: the highest dense-matmul FLOP/s measured in this
    run, in the step's dtype and on its threads (torch's intra-op setting, fixed before).

    On a shared CPU a measurement made while other processes run is low, and training that
    later runs uncontended would score above 1.0 against it; so the peak is the best of
    several bursts at start and is measured again (one short burst) at every logged step,
    keeping the maximum: a row's MFU is against a peak measured no earlier than the row.
    """

    device: torch.device
    dtype: torch.dtype
    best: float = 0.0
    _matrix: torch.Tensor | None = None

    def measure(self, bursts: int = 1, seconds: float = 0.05) -> float:
        if self._matrix is None:
            n = 4096 if self.device.type == "cuda" else 1024
            # Its own generator: the global RNG drives dropout, and a resumed run must see
            # the same stream as an uninterrupted one.
            gen = torch.Generator(self.device).manual_seed(0)
            self._matrix = torch.randn(n, n, device=self.device, dtype=self.dtype, generator=gen)
            self._matrix @ self._matrix  # warm-up
            self._sync()
        a, n = self._matrix, self._matrix.shape[0]
        for _ in range(bursts):
            reps, t0 = 0, time.perf_counter()
            while reps == 0 or time.perf_counter() - t0 < seconds:
                a @ a
                self._sync()
                reps += 1
            self.best = max(self.best, 2 * n**3 * reps / (time.perf_counter() - t0))
        return self.best

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def measure_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Dense matmul FLOP/s on this device: the best of five bursts."""
    return PeakFlops(device, dtype).measure(bursts=5)


@torch.no_grad()
def estimate_val_loss(
    model, tokens: Tokens | np.ndarray, cfg: TrainConfig, max_seq_len: int, device
) -> float:
    """Mean next-token loss over non-overlapping windows of `max_seq_len` tokens spread evenly
    across the validation split (all of it when eval_batches x batch_size windows cover it),
    the same windows every time, in float32: keep_best selects on the numbers the exported
    model is scored with."""
    available = (len(tokens) - 1) // max_seq_len
    if available < 1:
        raise LmopsError(
            f"val split has {len(tokens)} tokens, fewer than model.max_seq_len + 1 = {max_seq_len + 1}"
        )
    n_windows = min(available, cfg.eval_batches * cfg.batch_size)
    starts = np.linspace(0, available - 1, n_windows).round().astype(np.int64) * max_seq_len
    model.eval()
    loss_sum = 0.0
    for first in range(0, n_windows, cfg.batch_size):
        rows = np.stack(
            [tokens[s : s + max_seq_len + 1].astype(np.int64) for s in starts[first : first + cfg.batch_size]]
        )
        xy = torch.from_numpy(rows).to(device)
        loss_sum += model(xy[:, :-1], xy[:, 1:])[1].item() * len(rows)
    model.train()
    return loss_sum / n_windows


def write_log(rows: list[dict], train_path: Path = TRAIN_LOG_FILE, val_path: Path = VAL_LOG_FILE) -> None:
    """The plots' data: every logged row in `train_path`, the evaluated ones in `val_path`."""
    for path, columns, kept in (
        (train_path, LOG_COLUMNS, rows),
        (val_path, VAL_COLUMNS, [r for r in rows if r.get("val_loss") is not None]),
    ):
        lines = [",".join(columns)] + [",".join(f"{r[c]:.6g}" for c in columns) for r in kept]
        atomic.write_text(path, "\n".join(lines) + "\n")


@dataclass
class Progress:
    """Where a run stands. Saved in every checkpoint, so a resumed run continues exactly."""

    step: int = 0
    tokens: int = 0
    run_id: str | None = None
    history: list[dict] = field(default_factory=list)
    tracked_rows: int = 0  # rows of `history` the tracking store has
    best_step: int | None = None
    best_val_loss: float | None = None
    evals_since_best: int = 0
    plateau_decays: int = 0  # learning-rate cuts so far (lr_schedule: plateau)
    evals_since_plateau: int = 0  # evaluations without improvement since the best or the last cut
    stop_reason: str | None = None
    continued_from: str | None = None  # "<run id> at step N": trained on under a new max_steps

    def record_eval(self, step: int, val_loss: float) -> bool:
        """Count one evaluation; True when it is the lowest validation loss so far."""
        if self.best_val_loss is not None and val_loss >= self.best_val_loss:
            self.evals_since_best += 1
            return False
        self.best_step, self.best_val_loss, self.evals_since_best = step, val_loss, 0
        return True

    def patience_exhausted(self, patience: int | None) -> bool:
        return patience is not None and self.evals_since_best >= patience

    def record_plateau(self, improved: bool, cfg: TrainConfig) -> bool:
        """After an evaluation: True when the plateau schedule cuts the learning rate now."""
        self.evals_since_plateau = 0 if improved else self.evals_since_plateau + 1
        floored = plateau_lr(cfg, self.plateau_decays) <= cfg.min_lr
        if self.evals_since_plateau < cfg.lr_plateau_patience or floored:
            return False
        self.plateau_decays, self.evals_since_plateau = self.plateau_decays + 1, 0
        return True


@dataclass
class Run:
    """Everything one training run works with, built once by `_setup`."""

    params: Params
    device: torch.device
    ddp: Dist
    model: Llama  # the weights; `forward` is this model or its DDP wrapper
    forward: torch.nn.Module
    opt: Optimizer
    train_tokens: Tokens  # memory-mapped shards: every rank reads the same files
    val_tokens: Tokens
    autocast: contextlib.AbstractContextManager
    precision: torch.dtype
    fingerprint: str
    ckpt_dir: Path
    manifest: dict
    progress: Progress
    compiled: bool = False  # `forward` runs through torch.compile (train.compile, and it worked)
    best: dict[str, torch.Tensor] | None = None  # CPU copy of the best weights (keep_best, main rank)
    data_choices: dict = field(default_factory=dict)  # the epochs and each `auto`'s choice (follow_the_data)

    @property
    def cfg(self) -> TrainConfig:
        return self.params.train


def train(
    params: Params, data_dir: Path = PROCESSED_DIR, out_dir: Path = MODEL_DIR, ckpt_dir: Path = CHECKPOINT_DIR
) -> ModelMeta | None:
    """Train, export the model directory; its lmops.json (None on every rank but the first)."""
    device = resolve_device(params.train.device)
    if params.train.threads:
        torch.set_num_threads(params.train.threads)
    deterministic_kernels(device)
    ddp = setup_distributed(device)
    try:
        run = _setup(params, device, ddp, data_dir, ckpt_dir)
        _loop(run)
        result = _finish(run, out_dir) if ddp.main else None
        if ddp.world > 1:
            leave_distributed(run)
        return result
    finally:
        if dist.is_initialized():  # a rank that failed: leave without waiting for the others
            dist.destroy_process_group()


def _setup(params: Params, device: torch.device, ddp: Dist, data_dir: Path, ckpt_dir: Path) -> Run:
    """Data, model, optimizer, and the checkpoint to resume from when it matches."""
    stats_path = TOKENIZER_DIR / "stats.json"
    if not stats_path.is_file():
        raise LmopsError(f"{stats_path} not found: run `lmops tokenize` first")
    vocab_size = json.loads(stats_path.read_text())["vocab_size"]
    tokens_dir = data_dir / TOKENS_DIR.name
    check_tokenizer(tokens_dir, load_tokenizer(TOKENIZER_DIR))
    train_tokens = read_tokens(tokens_dir, "train")
    params, data_choices = follow_the_data(params, len(train_tokens), ddp.world)
    torch.manual_seed(params.train.seed)  # identical initial weights on every rank
    model = Llama(LlamaConfig(vocab_size=vocab_size, **params.model.model_dump())).to(device)
    precision = resolve_precision(params.train.precision, device)
    if not ddp.main:
        log.setLevel(logging.WARNING)  # one rank reports progress
    run = Run(
        params=params,
        device=device,
        ddp=ddp,
        model=model,
        forward=model,
        opt=make_optimizer(model, params.train, device),
        train_tokens=train_tokens,
        val_tokens=read_tokens(tokens_dir, "val"),
        autocast=autocast(device, precision),
        precision=precision,
        fingerprint=fingerprint(params, ddp.world, train_tokens.digest),
        ckpt_dir=ckpt_dir,
        manifest=json.loads(MANIFEST_FILE.read_text()) if MANIFEST_FILE.is_file() else {},
        progress=Progress(),
        data_choices=data_choices,
    )
    _resume(run)
    if ddp.world > 1:
        run.forward = torch.nn.parallel.DistributedDataParallel(model)
    if params.train.compile:
        _compile(run)
    return run


def _compile(run: Run) -> None:
    """Compile the training forward and backward now, on a dummy batch, so that compile
    time is not counted as the first step's, under a forked RNG so that a resumed run
    draws the same dropout masks as an uninterrupted one. Where inductor cannot compile
    (no C++ compiler on CPU) the run trains eagerly, with a warning."""
    # fallback_random: dropout masks from torch's own generator, not inductor's Philox
    # kernels (faster on CPU; measured in benchmarks/README.md, "Training speed").
    compiled = torch.compile(run.forward, options={"fallback_random": True})
    # A batch cut by `windows`, as every step's is: its inputs are views of one (B, T + 1)
    # tensor, and a contiguous dummy's strides failed the graph's guards at the first step,
    # which compiled it all again.
    seq_len = run.params.model.max_seq_len
    x, y = windows(np.zeros(seq_len + 1, dtype=np.int64), [0] * run.cfg.batch_size, seq_len, run.device)
    log.info(
        "compiling the training step (on 2 CPU cores about 30 s the first time, seconds once "
        "inductor's on-disk cache is warm; train.compile: false skips it)"
    )
    started = time.perf_counter()
    try:
        with torch.random.fork_rng(devices=[run.device] if run.device.type == "cuda" else []):
            compiled.train()
            with run.autocast:
                _, loss = compiled(x, y)
            loss.backward()
    except Exception as exc:  # inductor raises its own error types (InvalidCxxCompiler, ...)
        log.warning("torch.compile unavailable, training eagerly: %s", str(exc).strip().splitlines()[0])
        return
    finally:
        run.opt.zero_grad(set_to_none=True)
    run.forward, run.compiled = compiled, True
    log.info("compiled the training step in %.1f s", time.perf_counter() - started)


def before_cooldown(ckpt_dir: Path) -> Path:
    """Where wsd keeps the checkpoint of its cooldown's first step (the last is in `ckpt_dir`)."""
    return ckpt_dir.with_name(f"{ckpt_dir.name}-before-cooldown")


def _resume(run: Run) -> None:
    """Resume from the last checkpoint, or else wsd's before its cooldown, when it is a state
    of this run (`continues`). Under another max_steps the run goes on in a new MLflow run
    (the old one may be finished), which gets every row from the first step."""
    for ckpt_dir in (run.ckpt_dir, before_cooldown(run.ckpt_dir)):
        state_path = ckpt_dir / "state.json"
        if not state_path.is_file():
            continue
        saved = json.loads(state_path.read_text())
        if saved.get("fingerprint") != run.fingerprint:
            log.info("ignoring checkpoint in %s: made with other params or data", ckpt_dir)
            continue
        if not continues(run.cfg, saved["max_steps"], saved["step"]):
            log.info(
                "ignoring checkpoint in %s: step %d of a %d-step %s run is not one of a %d-step run",
                ckpt_dir,
                saved["step"],
                saved["max_steps"],
                run.cfg.lr_schedule,
                run.cfg.max_steps,
            )
            continue
        state = load_checkpoint(ckpt_dir, run.model, run.opt)
        progress = Progress(**{f.name: state[f.name] for f in fields(Progress) if f.name in state})
        if "tracked_rows" not in state:  # older checkpoints: every row was logged before it was saved
            progress.tracked_rows = len(progress.history)
        if saved["max_steps"] != run.cfg.max_steps:
            progress.continued_from = f"{progress.run_id} at step {progress.step}"
            progress.run_id, progress.tracked_rows = None, 0
        run.progress = progress
        run.best = state["best"] if run.ddp.main else None
        log.info("resuming from %s at step %d", ckpt_dir, progress.step)
        return


def _loop(run: Run) -> None:
    cfg, ddp, progress = run.cfg, run.ddp, run.progress
    peak = PeakFlops(run.device, run.precision)
    peak.measure(bursts=5)  # then once more at every logged step
    flops_per_token = run.model.flops_per_token()
    tokens_per_step = cfg.batch_size * run.params.model.max_seq_len * cfg.grad_accum_steps * ddp.world
    if ddp.main:
        with tracking.store_errors(tracking.tracking_uri(run.params.mlflow)):  # nothing written yet
            _start_tracking(run)
        with _tracking(run):
            _log_new_rows(run)  # those a resumed run's tracking server missed
    run.forward.train()
    bar = tqdm(
        range(progress.step, cfg.max_steps if progress.stop_reason is None else progress.step),
        initial=progress.step,
        total=cfg.max_steps,
        desc="train",
        unit="step",
        disable=None if ddp.main else True,  # None: off when stderr is no terminal (a log file)
        dynamic_ncols=True,
    )
    t_last, tokens_last, warned_mfu = time.perf_counter(), progress.tokens, False
    for step in bar:
        lr = lr_at(step, cfg, progress.plateau_decays)
        train_loss = _train_step(run, step, lr)
        progress.tokens += tokens_per_step
        progress.step = done = step + 1

        row = None
        evaluate = done % cfg.eval_interval == 0 or done == cfg.max_steps
        if done % cfg.log_interval == 0 or evaluate:
            now = time.perf_counter()
            tps = (progress.tokens - tokens_last) / max(now - t_last, 1e-9)
            t_last, tokens_last = now, progress.tokens
            row = {
                "step": done,
                "tokens": progress.tokens,
                "train_loss": train_loss,
                "lr": lr,
                "tokens_per_sec": tps,
                "mfu": tps * flops_per_token / peak.measure() / ddp.world,
            }
            if row["mfu"] > 1 and not warned_mfu:
                warned_mfu = True  # once: the reason is the same every time
                log.warning(
                    "step %d: MFU %.2f is above 1.0: this step ran faster than any matmul measured "
                    "in the run (a CPU shared with other work); the MFU column overstates",
                    done,
                    row["mfu"],
                )
            bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tps:,.0f}")
        if evaluate:
            _evaluate(run, row)
        if row is not None and ddp.main:
            progress.history.append(row)
            with _tracking(run):
                _log_new_rows(run)
        stop = progress.stop_reason is not None
        if ddp.main and (done % cfg.checkpoint_interval == 0 or done == cfg.max_steps or stop):
            _checkpoint(run)
        if ddp.main and cfg.lr_schedule == "wsd" and done == cooldown_start(cfg.max_steps, cfg):
            _checkpoint(run, before_cooldown(run.ckpt_dir))
        crash_points.reached("train.step", done)
        if stop:
            break
    bar.close()


def _start_tracking(run: Run) -> None:
    """The MLflow run (a resumed training's own, tagged with the step it resumed at), its params,
    the data report and the splits it trains on."""
    progress = run.progress
    mlrun = tracking.start_training_run(run.params, progress.run_id, run.manifest.get("sha256"))
    progress.run_id = mlrun.info.run_id
    if progress.step:
        earlier = mlrun.data.tags.get("resumed_at_steps")
        steps = f"{earlier},{progress.step}" if earlier else str(progress.step)
        tracking.set_tags(progress.run_id, {"resumed_at_steps": steps})
    if progress.continued_from:
        tracking.set_tags(progress.run_id, {"continued_from": progress.continued_from})
    tracking.log_params_once(
        run.params,
        progress.run_id,
        extra={
            "num_params": run.model.num_params(),
            "vocab_size": run.model.config.vocab_size,  # the tokenizer's (tokenizer.vocab_size may be auto)
            "world_size": run.ddp.world,
            "device": run.device.type,
            "compute_dtype": str(run.precision).removeprefix("torch."),
            "compiled": run.compiled,
            "tokens_per_parameter": round(
                run.data_choices["epochs"] * len(run.train_tokens) / run.model.num_params(), 3
            ),
            **run.data_choices,
        },
    )
    tracking.log_data_report(progress.run_id)
    tracking.log_splits(progress.run_id, run.params.data.source)


@contextlib.contextmanager
def _tracking(run: Run, checkpoint: bool = True) -> Iterator[None]:
    """Tracking calls mid-run: a store that fails past MLflow's retries stops the run with a
    checkpoint (the unlogged rows in it; `_finish` has one of the last step already) and one
    line saying how to go on."""
    try:
        with tracking.store_errors(tracking.tracking_uri(run.params.mlflow)):
            yield
    except LmopsError as exc:
        if checkpoint:
            _checkpoint(run)
        raise LmopsError(
            f"{exc}; training stopped at step {run.progress.step} with a checkpoint in {run.ckpt_dir}: "
            "run `lmops train` again to resume (into the same MLflow run)"
        ) from None


def _log_new_rows(run: Run) -> None:
    progress = run.progress
    for row in progress.history[progress.tracked_rows :]:
        tracking.log_step(progress.run_id, row)
        progress.tracked_rows += 1


def _train_step(run: Run, step: int, lr: float) -> float:
    """One optimizer step over grad_accum_steps micro-batches; returns the mean micro-batch loss."""
    cfg, ddp = run.cfg, run.ddp
    for group in run.opt.param_groups:
        group["lr"] = lr * group["lr_scale"]  # Muon's peak is muon_lr (lmops.pipeline.optim)
    loss_sum = 0.0
    for micro in range(cfg.grad_accum_steps):
        first = ((step * cfg.grad_accum_steps + micro) * ddp.world + ddp.rank) * cfg.batch_size
        x, y = batch(
            run.train_tokens, run.params.model.max_seq_len, cfg.batch_size, cfg.seed, first, run.device
        )
        sync = micro == cfg.grad_accum_steps - 1 or ddp.world == 1
        with contextlib.nullcontext() if sync else run.forward.no_sync(), run.autocast:
            _, loss = run.forward(x, y)
        (loss / cfg.grad_accum_steps).backward()
        loss_sum += loss.item()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(run.forward.parameters(), cfg.grad_clip)
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    return loss_sum / cfg.grad_accum_steps


def _evaluate(run: Run, row: dict) -> None:
    """Validation loss into `row`; track the best weights, cut the plateau learning rate,
    and decide on early stopping."""
    cfg, progress = run.cfg, run.progress
    val_loss = estimate_val_loss(run.model, run.val_tokens, cfg, run.params.model.max_seq_len, run.device)
    if run.ddp.world > 1:  # every rank must take the same early-stopping decision
        t = torch.tensor(val_loss, dtype=torch.float64, device=run.device)
        dist.all_reduce(t)
        val_loss = t.item() / run.ddp.world
    row["val_loss"] = val_loss
    log.info("step %d: train %.4f val %.4f", row["step"], row["train_loss"], val_loss)
    improved = progress.record_eval(row["step"], val_loss)
    if improved and cfg.keep_best and run.ddp.main:
        run.best = weights_of(run.model)
    if cfg.lr_schedule == "plateau" and progress.record_plateau(improved, cfg):
        log.info(
            "plateau: validation loss did not improve for %d evaluations; learning rate now %.3g",
            cfg.lr_plateau_patience,
            plateau_lr(cfg, progress.plateau_decays),
        )
    if progress.patience_exhausted(cfg.early_stopping_patience):
        progress.stop_reason = (
            f"early stopping at step {row['step']}: validation loss did not improve for "
            f"{progress.evals_since_best} evaluations (best {progress.best_val_loss:.4f} "
            f"at step {progress.best_step})"
        )
        log.info("%s", progress.stop_reason)


def _checkpoint(run: Run, ckpt_dir: Path | None = None) -> None:
    state = {**asdict(run.progress), "fingerprint": run.fingerprint, "max_steps": run.cfg.max_steps}
    save_checkpoint(ckpt_dir or run.ckpt_dir, run.model, run.opt, state, run.best)
    write_log(run.progress.history)


def _finish(run: Run, out_dir: Path) -> ModelMeta:
    """Export the model (the best weights under keep_best), log it, close the MLflow run."""
    progress = run.progress
    exported = progress.history[-1] if progress.history else {}
    if run.cfg.keep_best and run.best is not None:
        load_weights(run.model, run.best)
        exported = next(r for r in progress.history if r["step"] == progress.best_step)
        log.info(
            "keep_best: exporting the weights of step %d (val %.4f)",
            progress.best_step,
            progress.best_val_loss,
        )
    stop_reason = progress.stop_reason or f"reached max_steps ({run.cfg.max_steps})"
    meta = ModelMeta(
        run_id=progress.run_id,
        data_sha256=run.manifest.get("sha256"),
        git_commit=tracking.git_commit(),
        metrics={
            "train_loss": exported.get("train_loss"),
            "val_loss": exported.get("val_loss"),
            "exported_step": exported.get("step"),
            "best_step": progress.best_step,
            "steps": progress.step,
            "tokens": progress.tokens,
        },
        stop_reason=stop_reason,
        num_params=run.model.num_params(),
    )
    write_model_dir(run.model, TOKENIZER_DIR, out_dir, meta)
    write_log(progress.history)
    with _tracking(run, checkpoint=False):
        tracking.log_metrics(
            progress.run_id,
            {"best_step": progress.best_step, "best_val_loss": progress.best_val_loss},
            step=progress.step,
        )
        tracking.set_tags(
            progress.run_id, {"stop_reason": stop_reason, "exported_step": str(exported.get("step"))}
        )
        tracking.log_model(progress.run_id, out_dir)
        tracking.link_model_to_splits(progress.run_id, step=exported.get("step", progress.step))
        tracking.end_run(progress.run_id)
    log.info("model written to %s (run %s)", out_dir, progress.run_id)
    return meta
