"""Checkpoints: weights, optimizer, RNG and run state, written atomically, checked on load.

A checkpoint is a directory of safetensors files plus `state.json` (the run's
progress and every file's sha256), so a truncated or corrupt one is an error
naming the file, never a silent restart, and nothing in it is pickle.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lmops import atomic
from lmops.errors import LmopsError
from lmops.pipeline.params import Params
from lmops.runtime.model import Llama


def fingerprint(params: Params, world: int, train_digest: str) -> str:
    """What a checkpoint must match to be resumed: config, world size and the exact data
    (the train split's token digest, from its shards' sha256). Not `train.max_steps`: the
    checkpoint's state says which, and the schedule whether it continues under another
    (`lmops.pipeline.train.continues`)."""
    train = params.train.model_dump(exclude={"max_steps"})
    h = hashlib.sha256(
        json.dumps(
            {"model": params.model.model_dump(), "train": train, "world": world},
            sort_keys=True,
        ).encode()
    )
    h.update(train_digest.encode())
    return h.hexdigest()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def weights_of(model: Llama) -> dict[str, torch.Tensor]:
    """CPU copies of the weights, without the tied lm_head (safetensors refuses shared tensors)."""
    return {
        k: v.detach().to("cpu", copy=True).contiguous()
        for k, v in model.state_dict().items()
        if not (model.config.tie_embeddings and k == "lm_head.weight")
    }


def load_weights(model: Llama, weights: dict[str, torch.Tensor]) -> None:
    weights = dict(weights)
    if model.config.tie_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    device = next(model.parameters()).device
    model.load_state_dict({k: v.to(device) for k, v in weights.items()})


def save_checkpoint(
    ckpt_dir: Path,
    model: Llama,
    opt: torch.optim.Optimizer,
    state: dict,
    best: dict[str, torch.Tensor] | None = None,
) -> None:
    """Weights, optimizer, RNG, `state` and (keep_best) the best weights so far, atomically."""
    with atomic.directory(ckpt_dir) as tmp:
        files = {"model.safetensors": weights_of(model)}
        if best is not None:
            files["best.safetensors"] = best
        opt_state = opt.state_dict()
        tensors = {"rng.torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            tensors["rng.cuda"] = torch.cuda.get_rng_state()
        for idx, slots in opt_state["state"].items():
            for name, value in slots.items():
                tensors[f"optim.{idx}.{name}"] = value.detach().cpu().contiguous()
        files["optimizer.safetensors"] = tensors
        for name, content in files.items():
            save_file(content, str(tmp / name))
        state = {
            **state,
            "param_groups": opt_state["param_groups"],
            "sha256": {f: _sha256(tmp / f) for f in files},
        }
        (tmp / "state.json").write_text(json.dumps(state, indent=1))


def load_checkpoint(ckpt_dir: Path, model: Llama, opt: torch.optim.Optimizer) -> dict:
    """Restore weights, optimizer and RNG; a damaged checkpoint is an error, never ignored.

    Returns the saved state, with the best weights so far under "best" (None when absent).
    """
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
        best = (
            load_file(str(ckpt_dir / "best.safetensors")) if "best.safetensors" in state["sha256"] else None
        )
    except LmopsError:
        raise
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        raise LmopsError(f"checkpoint {ckpt_dir} is unreadable ({exc}); {hint}") from None
    load_weights(model, weights)
    device = next(model.parameters()).device
    slots: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, idx, name = key.split(".", 2)
            slots.setdefault(int(idx), {})[name] = value if name == "step" else value.to(device)
    opt.load_state_dict({"state": slots, "param_groups": state["param_groups"]})
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    return {**state, "best": best}
