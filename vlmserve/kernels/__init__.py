"""Compute kernels chosen once, when the engine is built; never at import time."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from vlmserve.kernels.op import LinearOp

__all__ = ["LinearOp", "select_linear_op"]


def select_linear_op(device: torch.device, dtype: torch.dtype, shapes: Iterable[tuple[int, int]] = ()) -> LinearOp:
    """The matrix product for Linear layers: on the CPU in bf16, per layer shape (out, in) and
    row count, the fastest of the CPU kernels that build here and torch's (kernels/dispatch.py);
    torch's F.linear everywhere else."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        from vlmserve.kernels.dispatch import build_dispatch

        return build_dispatch(shapes)
    return F.linear
