"""Weight-only int8: the decoder's linear layers (and lm_head) rebuilt, once the float weights are
loaded, as int8 matrices with one fp32 scale per output channel; activations stay in the model's
dtype. The vision tower keeps its float weights: it runs once per image over hundreds to
thousands of patch rows at a time, a compute-bound GEMM that int8 weights do not speed up (they
must be dequantized first) and whose outputs every later token reads, so precision there is
worth more than its few hundred MB. MoE routers (`gate`, `shared_expert_gate`) stay float too:
they are tiny and choose the experts. Stacked expert weights are parameters, not Linear layers,
and stay float."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.kernels import LinearOp
from vlmserve.kernels.int8 import Int8Kernel, int8_linear
from vlmserve.models.layers import Linear
from vlmserve.models.parallel import ShardSpec

# Module names (any path segment) whose Linear layers keep their float weights.
UNQUANTIZED_MODULES = ("visual", "gate", "shared_expert_gate")


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per output row: [N, K] float -> (q int8 [N, K], scale fp32 [N]),
    q = round(w / scale) in -127..127, scale = max|w_row| / 127 (1 for an all-zero row)."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class Int8Linear(nn.Module):
    """y = x @ (qweight * scales[:, None]).T + bias, in x's dtype (fp32 arithmetic inside)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        # Parameters (never trained) so that memory plans and counts see them.
        self.qweight = nn.Parameter(qweight, requires_grad=False)  # [N, K] int8
        self.scales = nn.Parameter(scales, requires_grad=False)  # [N] fp32
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)  # [N], model dtype
        self.kernel: Int8Kernel | None = None  # the decode kernel, bound when the model is built
        # A tensor-parallel layer's collective after the product (models/parallel.py), kept.
        self.collective: Callable[[torch.Tensor], torch.Tensor] | None = None
        # The float weight's tensor-parallel slice, where it had one (read by LoRA adapters).
        self.tp_shards: dict[str, ShardSpec] = {}

    # The float product for many rows (prefill), on dequantized weights: the one the model's
    # float Linear layers use (bind_linear_op binds it).
    uses_linear_op = True
    op: LinearOp = staticmethod(F.linear)  # type: ignore[assignment]

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        q, scale = quantize_per_channel(linear.weight.detach())
        # A row-parallel layer adds its bias on rank 0 only.
        keep_bias = linear.bias is not None and getattr(linear, "bias_in_product", True)
        quantized = cls(q, scale, linear.bias.detach() if keep_bias else None)
        quantized.collective = getattr(linear, "collective", None)
        spec = getattr(linear, "tp_shards", {}).get("weight")
        if spec is not None:  # which slice of the checkpoint's rows or columns it holds (LoRA reads it)
            quantized.tp_shards = {"qweight": spec}
        return quantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_linear(x, self.qweight, self.scales, self.bias, self.kernel, self.op)
        return y if self.collective is None else self.collective(y)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def keeps_float(name: str) -> bool:
    return any(part in UNQUANTIZED_MODULES for part in name.split("."))


def quantize_int8(model: nn.Module, kernel: Int8Kernel | None) -> list[str]:
    """Replace every quantizable Linear in place; the names replaced, in order."""
    targets = [
        (name, module) for name, module in model.named_modules() if isinstance(module, Linear) and not keeps_float(name)
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        quantized = Int8Linear.from_linear(module)
        quantized.kernel = kernel
        setattr(parent, child, quantized)
    return [name for name, _ in targets]
