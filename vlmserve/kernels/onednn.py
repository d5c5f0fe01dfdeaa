"""oneDNN's linear product on a weight reordered once into its blocked layout (torch's bf16
`linear` reorders the plain weight on every call); models/prepack.py says where it is used and why."""

from __future__ import annotations

import os

import torch

# The row count oneDNN is told to expect when it reorders (a 448x448 image's patches); its choice
# of blocking did not change the speed at 64-4096 rows on the Zen 4 machine of docs/benchmarks.md.
ROWS_HINT = 1024


def prepack_available() -> bool:
    """Whether this torch has oneDNN's bf16 reorder and product (and VLMSERVE_PREPACK is not 0)."""
    if os.environ.get("VLMSERVE_PREPACK", "1") == "0":
        return False
    mkldnn = torch.ops.mkldnn
    try:
        return bool(torch.backends.mkldnn.is_available() and mkldnn._is_mkldnn_bf16_supported()) and hasattr(
            mkldnn, "_reorder_linear_weight"
        )
    except (AttributeError, RuntimeError):
        return False


def reorder_weight(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 [out, in] weight in oneDNN's layout: an opaque tensor of the same shape and dtype."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT)


def prepacked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear for a weight from reorder_weight (a LinearOp)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
