"""oneDNN's linear product on a weight reordered once into its blocked layout (torch's bf16
`linear` reorders the plain weight on every call), and vlmserve's few-row product on that same
layout; models/prepack.py says where they are used and why."""

from __future__ import annotations

import ctypes
import os
from functools import cache

import torch

from vlmserve.kernels.cpu import load_avx512_kernels

# The row count oneDNN is told to expect when it reorders (a 448x448 image's patches); its choice
# of blocking did not change the speed at 64-4096 rows on the Zen 4 machine of docs/benchmarks.md,
# nor the layout (PACKED_BLOCK) at 1-4096.
ROWS_HINT = 1024
# Up to this many rows packed_linear runs vlmserve's AVX-512 kernel on the reordered weight (a
# decode step's rows); more, oneDNN's product. On the Zen 4 machine (2 threads, Qwen2-VL-2B's
# decoder shapes) the kernel was ahead of oneDNN's product on the same weight at 1-32 rows:
# [17920, 1536] 0.92 against 1.26 ms at 1 row, 4.40 against 4.51 at 32.
PACKED_ROWS = 32
# oneDNN's layout for a bf16 [N, K] weight, as found on that machine for every hint: blocks of 64
# output rows, each [K / 2][64][2] (pairs of k beside each other, for vdpbf16ps); packed_layout
# checks it on the machine at hand before vlmserve's kernel reads one.
PACKED_BLOCK = 64
# The attribute on which models/prepack.py records a reordered parameter's weight_address.
ADDRESS_ATTR = "onednn_address"


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


def weight_address(weight: torch.Tensor) -> int:
    """Where a reordered weight's memory starts (an opaque tensor has no data_ptr())."""
    return int(torch.ops.mkldnn.data_ptr(weight))


def weight_nbytes(weight: torch.Tensor) -> int:
    return int(torch.ops.mkldnn._nbytes(weight))


def packed_order(weight: torch.Tensor) -> torch.Tensor:
    """A plain bf16 [N, K] weight's elements in the order of the layout vlmserve's kernel reads
    (PACKED_BLOCK), as a flat tensor: what the reordered weight's memory must hold."""
    n, k = weight.shape
    return weight.reshape(n // PACKED_BLOCK, PACKED_BLOCK, k // 2, 2).permute(0, 2, 1, 3).flatten()


@cache
def packed_layout(n: int, k: int) -> bool:
    """Whether oneDNN reorders a bf16 [n, k] weight into the layout vlmserve's kernel reads, checked
    once per shape on a probe: every element where the kernel will look for it."""
    if n % PACKED_BLOCK or k % 2:
        return False
    probe = torch.randint(0, 0x3F80, (n, k), dtype=torch.int16, generator=torch.Generator().manual_seed(n + k))
    probe = probe.view(torch.bfloat16)  # positive finite values: the reorder copies them bit for bit
    packed = reorder_weight(probe)
    if weight_nbytes(packed) != probe.numel() * 2:
        return False
    memory = torch.empty(probe.numel(), dtype=torch.bfloat16)
    ctypes.memmove(memory.data_ptr(), weight_address(packed), weight_nbytes(packed))
    return torch.equal(memory.view(torch.int16), packed_order(probe).view(torch.int16))


def prepacked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear for a weight from reorder_weight (a LinearOp)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# Activations oneDNN applies to a product's float32 result before rounding it (a post-op): the
# checkpoint's activation name -> (oneDNN's algorithm, its approximation).
FUSED_ACTIVATIONS = {"gelu": ("gelu", "none"), "gelu_pytorch_tanh": ("gelu", "tanh")}


def prepacked_linear_activation(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str
) -> torch.Tensor:
    """act(F.linear(x, weight, bias)) in one pass for a weight from reorder_weight and an
    activation of FUSED_ACTIVATIONS: the activation's separate pass over the output is most of a
    second of a 2B's tower on 8 images of 448 x 448 (fc1 of 8 x 784 patches: 104 -> 75 ms a block
    on 2 Zen 5 cores), and it rounds once instead of twice."""
    algorithm, approximation = FUSED_ACTIVATIONS[activation]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, algorithm, [], approximation)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear for a reordered weight whose layout packed_layout confirmed (a LinearOp): up to
    PACKED_ROWS rows vlmserve's AVX-512 kernel reads it in place, more rows oneDNN's product. A
    decode step calls this for every layer: the weight's address is the one models/prepack.py
    recorded on the parameter (ADDRESS_ATTR) where there is one (asking oneDNN costs ~2 us)."""
    kernels = load_avx512_kernels()
    if kernels is not None and x.numel() <= PACKED_ROWS * x.shape[-1] and x.dtype == torch.bfloat16:
        address = getattr(weight, ADDRESS_ATTR, None)
        y = kernels.linear_packed(x, weight, weight_address(weight) if address is None else address, bias)
        if y is not None:
            return y
    return prepacked_linear(x, weight, bias)
