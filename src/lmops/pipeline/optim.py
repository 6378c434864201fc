"""The optimizers (`train.optimizer`): AdamW for every weight, or Muon for the decoder
layers' matrices with AdamW for the rest.

Muon (torch.optim.Muon) orthogonalises each matrix's momentum (Newton-Schulz, in bfloat16),
so every direction of a linear map between hidden states moves at the same rate. That fits
the attention and MLP projections; the embedding (rows looked up one token at a time), the
head (tied to it, or not) and the norms' gains are vectors or lookups, and stay with AdamW,
as in Keller Jordan's and Moonshot's recipes. Every parameter group carries `lr_scale`, its
peak rate over `train.learning_rate`: the training loop sets each group's rate to the
schedule's value times it, so both optimizers follow one schedule.
"""

from __future__ import annotations

import torch
from torch.optim._muon import _adjust_lr  # torch is pinned exactly (2.13.0)

from lmops.errors import LmopsError
from lmops.pipeline.params import TrainConfig
from lmops.runtime.model import Llama, bf16_native


class MuonAdamW:
    """Muon and AdamW stepped as one optimizer. Its state dict is one torch-style dict whose
    parameters are numbered across both (Muon's first), so a checkpoint stores and restores
    it exactly as it does AdamW's alone."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW):
        self.parts = (muon, adamw)

    @property
    def param_groups(self) -> list[dict]:
        return [group for part in self.parts for group in part.param_groups]

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        merged: dict = {"state": {}, "param_groups": []}
        offset = 0
        for part in self.parts:
            own = part.state_dict()
            merged["state"].update({offset + i: slots for i, slots in own["state"].items()})
            merged["param_groups"] += [
                {**group, "params": [offset + i for i in group["params"]]} for group in own["param_groups"]
            ]
            offset += sum(len(group["params"]) for group in own["param_groups"])
        return merged

    def load_state_dict(self, state: dict) -> None:
        groups, offset = iter(state["param_groups"]), 0
        for part in self.parts:
            own = [next(groups) for _ in part.param_groups]
            ids = [i for group in own for i in group["params"]]
            part.load_state_dict(
                {
                    "state": {i - offset: state["state"][i] for i in ids if i in state["state"]},
                    "param_groups": [{**g, "params": [i - offset for i in g["params"]]} for g in own],
                }
            )
            offset += len(ids)


class Muon(torch.optim.Muon):
    """torch.optim.Muon, orthogonalising in `ns_dtype`. torch's runs Newton-Schulz in
    bfloat16, right where bfloat16 matrix products are native (CUDA, AVX512-BF16, AMX); on a
    CPU without them they are emulated, about 18x slower than float32's on an AVX2 EPYC,
    and orthogonalising took most of each training step. There it runs in float32: the
    same iteration, at least as accurate."""

    def __init__(self, params, ns_dtype: torch.dtype, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        if self.ns_dtype == torch.bfloat16:
            return super().step(closure)
        assert closure is None, "the training loop never passes a closure"
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            lr, momentum = group["lr"], group["momentum"]
            for param, grad, buf in zip(params, grads, bufs, strict=True):
                buf.lerp_(grad, 1 - momentum)  # as torch's _single_tensor_muon, from here
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonalise(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))
        return None


def orthogonalise(grad: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
    """torch's `_zeropower_via_newtonschulz` in the gradient's own dtype (float32)."""
    a, b, c = coefficients
    x = grad.T if grad.size(0) > grad.size(1) else grad.clone()
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


Optimizer = torch.optim.AdamW | MuonAdamW


def muon_matrices(model: Llama) -> list[torch.nn.Parameter]:
    """The decoder layers' matrices, Muon's share; their vectors (norms) stay with AdamW. A
    parameter of any other rank there is an error: Muon orthogonalises 2-D updates only."""
    matrices = []
    for name, p in model.model.layers.named_parameters(prefix="model.layers"):
        if p.dim() > 2:
            raise LmopsError(
                f"train.optimizer: muon updates 2-D matrices only, and {name} has shape "
                f"{tuple(p.shape)}; use train.optimizer: adamw"
            )
        if p.dim() == 2 and p.requires_grad:
            matrices.append(p)
    return matrices


def _adamw(params: list[torch.nn.Parameter], cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms), as in nanoGPT. The fused kernel on
    CUDA; on CPU the default (foreach) one measured as fast as fused."""
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay, "lr_scale": 1.0},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr_scale": 1.0},
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda"
    )


def make_optimizer(model: Llama, cfg: TrainConfig, device: torch.device) -> Optimizer:
    """`train.optimizer`'s optimizer over the model's trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "adamw":
        return _adamw(params, cfg, device)
    matrices = muon_matrices(model)
    taken = {id(p) for p in matrices}
    # match_rms_adamw: each matrix's update is scaled to AdamW's typical size (0.2 x
    # sqrt(max dim)), so muon_lr and weight_decay (decoupled: lr x weight_decay per step) mean
    # what they mean for AdamW.
    muon = Muon(
        [{"params": matrices, "lr_scale": cfg.muon_lr / cfg.learning_rate}],
        ns_dtype=torch.bfloat16 if bf16_native(device) else torch.float32,
        lr=cfg.muon_lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.muon_momentum,
        adjust_lr_fn="match_rms_adamw",
    )
    return MuonAdamW(muon, _adamw([p for p in params if id(p) not in taken], cfg, device))
