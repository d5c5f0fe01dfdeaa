"""Building blocks shared by the model families. Precision handling follows the reference
implementations so that bfloat16 runs round where they round."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.kernels import LinearOp
from vlmserve.kernels.cpu import Avx512Kernels, CpuKernels, load_cpu_kernels
from vlmserve.kernels.dispatch import avx512_kernels
from vlmserve.kernels.onednn import (
    FUSED_ACTIVATIONS,
    packed_linear,
    prepacked_linear,
    prepacked_linear_activation,
)


class Linear(nn.Linear):
    """nn.Linear whose matrix product is chosen when the engine is built (bind_linear_op):
    torch's by default, a faster kernel where one exists for the device and dtype."""

    op: LinearOp = staticmethod(F.linear)  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.weight, self.bias)

    def forward_activated(self, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        """The activation (by its config name) of this layer's output in one oneDNN pass, where
        the layer runs on a reordered weight (the vision tower's), nothing is hooked on its output
        (a LoRA adapter's update comes before the activation) and no collective follows; None
        elsewhere: the caller applies the activation itself."""
        if self.op is not prepacked_linear or self._forward_hooks or activation not in FUSED_ACTIVATIONS:
            return None
        if getattr(self, "collective", None) is not None:
            return None
        return prepacked_linear_activation(x, self.weight, self.bias, activation)


def bind_linear_op(model: nn.Module, op: LinearOp) -> None:
    for module in model.modules():
        # Quantized layers (models/quant) use the same float product for their many-row path.
        if isinstance(module, Linear):
            module.op = op
        elif getattr(module, "uses_linear_op", False):
            module.op = op  # type: ignore[assignment]


def bound_linear_op(model: nn.Module) -> LinearOp | None:
    """The op bind_linear_op bound (the first Linear layer's not on prepacked weights), None for a
    model without one."""
    prepacked = (prepacked_linear, packed_linear)
    return next((m.op for m in model.modules() if isinstance(m, Linear) and m.op not in prepacked), None)


def linear_shapes(model: nn.Module, exclude: Iterable[nn.Module | None] = ()) -> set[tuple[int, int]]:
    """The (out, in) shapes of the model's Linear layers (but those inside the modules of
    `exclude`): what the linear op is chosen for."""
    skip = {id(m) for module in exclude if module is not None for m in module.modules()}
    return {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, Linear) and id(m) not in skip}


def _cpu_bf16_kernels(*tensors: torch.Tensor) -> CpuKernels | None:
    """The CPU kernels of the element-wise layers (kernels/cpu_linear.c), where they apply: bf16
    tensors on the CPU and the kernels built (VLMSERVE_CPU_KERNELS=0: never)."""
    if all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors):
        return load_cpu_kernels()
    return None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = _cpu_bf16_kernels(x, self.weight)
        if kernels is not None and x.ndim == 2 and x.is_contiguous():
            return kernels.add_rms_norm(x, None, self.weight, self.eps)[1]
        # Normalise in float32, round to the input dtype, then scale (as transformers' Qwen2).
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def heads_(self, x: torch.Tensor) -> torch.Tensor:
        """This norm over each head of x [n, heads, head_dim] (Qwen3's q_norm, k_norm): in place
        on the CPU in bf16, where x's heads are contiguous (rows may be strided: a view of a fused
        qkv output; the same arithmetic as forward's kernel); else forward's result."""
        kernels = _cpu_bf16_kernels(x, self.weight)
        if kernels is not None and x.ndim == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
            kernels.rms_norm_heads_(x, self.weight, self.eps)
            return x
        return self(x)

    def add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, this norm of it): a residual add and the next norm, one kernel on the CPU."""
        kernels = _cpu_bf16_kernels(x, delta, self.weight)
        if kernels is not None and x.ndim == 2 and x.is_contiguous() and delta.is_contiguous():
            return kernels.add_rms_norm(x, delta, self.weight, self.eps)
        total = x + delta
        return total, self(total)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, head_dim] (the two halves of
    the head pair dimension i with i + head_dim / 2)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def apply_rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary on q [n, nq, D] and k [n, nk, D] (cos, sin in the activations' dtype). For bf16
    on the CPU one kernel rotates both in place (views of a fused qkv output may be passed: rows
    strided, heads contiguous)."""
    kernels = _rotary_kernels(q, k, cos, sin, torch.bfloat16)
    if kernels is not None:
        kernels.rotary_qk_(q, k, cos, sin)
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary_qk_fp32(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The vision towers' rotary (as the reference): q, k [n, heads, D] widened to fp32, rotated
    with fp32 cos, sin [n, D], rounded back to their dtype once. One kernel in place for bf16 on
    the CPU (torch's bf16 <-> fp32 copies alone took ~10 % of a Qwen2-VL-2B image encode)."""
    kernels = _rotary_kernels(q, k, cos, sin, torch.float32)
    if kernels is not None:
        kernels.rotary_qk_(q, k, cos, sin)
        return q, k
    rotate = lambda x: (x.float() * cos[:, None] + rotate_half(x.float()) * sin[:, None]).to(x.dtype)  # noqa: E731
    return rotate(q), rotate(k)


def _rotary_kernels(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cos_dtype: torch.dtype
) -> CpuKernels | Avx512Kernels | None:
    """The CPU kernels where their rotary applies to these tensors: bf16 q, k with contiguous heads,
    cos and sin [n, D] contiguous in `cos_dtype` (the arithmetic the caller asks for); the AVX-512
    ones where they build and no other path is forced (the same results, 16 lanes at a time)."""
    d = q.shape[-1]
    applies = (
        cos.dtype == sin.dtype == cos_dtype
        and cos.device.type == "cpu"
        and q.stride()[1:] == (d, 1)
        and k.stride()[1:] == (d, 1)
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.shape == sin.shape == (q.shape[0], d)
        and d % 2 == 0
    )
    kernels = _cpu_bf16_kernels(q, k) if applies else None
    return None if kernels is None else avx512_kernels() or kernels


def _avx512_activations(x: torch.Tensor) -> Avx512Kernels | None:
    """The AVX-512 kernels of the MLP activations where they apply: bf16 on the CPU, last dim
    contiguous, the kernels built, and no other CPU path forced (VLMSERVE_CPU_PATH=avx2/torch)."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.stride(-1) == 1 and x.numel():
        return avx512_kernels()
    return None


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    kernels = _avx512_activations(x)
    if kernels is not None:
        return kernels.quick_gelu(x)
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
        kernels = _avx512_activations(x)
        if kernels is not None:
            return kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
