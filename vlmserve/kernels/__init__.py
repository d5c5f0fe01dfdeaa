"""Compute kernels chosen once, when the engine is built; never at import time."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# (input, weight, bias) -> input @ weight.T + bias: what a Linear layer computes with.
LinearOp = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def select_linear_op(device: torch.device, dtype: torch.dtype) -> LinearOp:
    """The matrix product for Linear layers: the CPU bf16 kernel where it builds and the CPU
    supports it, torch's F.linear everywhere else."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        from vlmserve.kernels.cpu import load_cpu_kernels

        kernels = load_cpu_kernels()
        if kernels is not None:
            return kernels.linear_bf16
    return F.linear
