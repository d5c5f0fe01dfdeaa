"""Building blocks shared by the model families. Precision handling follows the reference
implementations so that bfloat16 runs round where they round."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.kernels import LinearOp


class Linear(nn.Linear):
    """nn.Linear whose matrix product is chosen when the engine is built (bind_linear_op):
    torch's by default, a faster kernel where one exists for the device and dtype."""

    op: LinearOp = staticmethod(F.linear)  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.weight, self.bias)


def bind_linear_op(model: nn.Module, op: LinearOp) -> None:
    for module in model.modules():
        # Quantized layers (models/quant) use the same float product for their many-row path.
        if isinstance(module, Linear):
            module.op = op
        elif getattr(module, "uses_linear_op", False):
            module.op = op  # type: ignore[assignment]


def bound_linear_op(model: nn.Module) -> LinearOp | None:
    """The op bind_linear_op bound (the first Linear layer's), None for a model without one."""
    return next((m.op for m in model.modules() if isinstance(m, Linear)), None)


def linear_shapes(model: nn.Module) -> set[tuple[int, int]]:
    """The (out, in) shapes of the model's Linear layers: what the linear op is chosen for."""
    return {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, Linear)}


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, round to the input dtype, then scale (as transformers' Qwen2).
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, head_dim] (the two halves of
    the head pair dimension i with i + head_dim / 2)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def get_activation(name: str):  # type: ignore[no-untyped-def]
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class SiluAndMul(nn.Module):
    """SwiGLU on a fused [gate | up] projection: silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
