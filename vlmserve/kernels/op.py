"""What a Linear layer computes with, as a type (its own module so that the kernels' modules and
the package's selection can all name it without importing each other)."""

from __future__ import annotations

from collections.abc import Callable

import torch

# (input, weight, bias) -> input @ weight.T + bias: what a Linear layer computes with.
LinearOp = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
