"""int8 weight-only quantization: every linear layer and the LM head, at load.

Each weight row (output channel) becomes int8 with its own scale, symmetric:
`scale = max|row| / 127`, `q = round(row / scale)`. Activations stay in floating
point. On CPU a product of few rows (decode) runs through torch's int8-weight kernel
(`aten._weight_int8pack_mm`), which is vectorized for bfloat16 activations only
(float32 ones take a scalar path ten times slower than a float32 matmul), so the
activations are rounded to bfloat16 for that product and the result cast back. That
kernel is a matrix-vector one: from `GEMM_ROWS` rows on (prefill, large decode batches)
the weight is instead dequantized on the fly, to bfloat16 where the CPU has bfloat16
matmul units (a bfloat16 GEMM there is about twice float32's), and goes through one GEMM;
the transient copy is one weight matrix at a time, no second copy is kept. Elsewhere
(CUDA, or an input width the kernel does not take) the weight is dequantized on the fly
to the activations' dtype. The embedding table stays float: a lookup reads one row.

The model is changed in place, before the engine is built: `Int8Weight` does for
the engine's fused forward what a weight tensor does there (`F.linear`,
`torch.cat` to fuse q/k/v, row slices, `.data` re-pointing), so the engine runs
the quantized model without a separate code path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmops.runtime.engine.config import check_quantization
from lmops.runtime.model import bf16_native

# _weight_int8pack_mm reads the input width in 16-element vectors (other widths crash it).
_KERNEL_ALIGN = 16
# From this many rows on, CPU products dequantize to a GEMM instead of the int8 kernel: the
# two cross over between about 12 and 20 rows, and from 64 rows on the kernel is slower than
# float32 (the per-linear timings: benchmarks/README.md, "int8 weights").
GEMM_ROWS = 16
# Whether the CPU's bfloat16 matmul is native; if not, dequantize to float32.
_CPU_BF16 = bf16_native(torch.device("cpu"))


class Int8Weight:
    """A weight matrix as int8 rows `q` (out, in) and per-row scales: `W ≈ q * scale[:, None]`."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        self.q, self.scale = q, scale

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Weight:
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scale.to(torch.bfloat16 if w.device.type == "cpu" else weight.dtype))

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def detach(self) -> Int8Weight:
        return self

    def tensors(self) -> list[torch.Tensor]:
        """What holds its numbers (where FusedForward moves its memory)."""
        return [self.q, self.scale]

    def __getitem__(self, rows) -> Int8Weight:
        return Int8Weight(self.q[rows], self.scale[rows])

    @property
    def data(self) -> Int8Weight:
        return self

    @data.setter
    def data(self, other: Int8Weight) -> None:  # `lin.weight.data = fused[a:b]`: share its storage
        self.q, self.scale = other.q, other.scale

    def matmul_t(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T, for x of shape (..., in)."""
        x2 = x.reshape(-1, x.shape[-1])
        cpu = x.device.type == "cpu"
        if cpu and x2.shape[0] < GEMM_ROWS and x.shape[-1] % _KERNEL_ALIGN == 0:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), self.q, self.scale)
        else:  # int8 values are exact in bfloat16; the row scales apply to the product
            dtype = torch.bfloat16 if cpu and _CPU_BF16 else x.dtype
            y = F.linear(x2.to(dtype), self.q.to(dtype)).to(x.dtype).mul_(self.scale.to(x.dtype))
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and isinstance(args[1], Int8Weight) and kwargs.get("bias", None) is None:
            return args[1].matmul_t(args[0])
        if func is torch.cat and all(isinstance(w, Int8Weight) for w in args[0]) and not kwargs.get("dim"):
            return Int8Weight(torch.cat([w.q for w in args[0]]), torch.cat([w.scale for w in args[0]]))
        return NotImplemented


class Int8Linear(nn.Module):
    """A bias-free nn.Linear whose weight is an `Int8Weight`."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("int8 quantization covers bias-free linears only")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = Int8Weight.from_float(linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


@torch.no_grad()
def quantize(model: nn.Module, method: str | None) -> nn.Module:
    """Replace every nn.Linear of `model` (the LM head included) in place; return it."""
    check_quantization(method)
    if method is None:
        return model
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child))
    return model
