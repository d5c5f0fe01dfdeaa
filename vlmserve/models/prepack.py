"""Linear layers on weights reordered once, at build time, into oneDNN's blocked layout: the vision
towers' (oneDNN's product at every row count) and the decoders' (oneDNN's product for prefill,
vlmserve's AVX-512 kernel on the same memory for decode).

torch's bf16 `linear` on the CPU hands oneDNN the weight in its plain [out, in] layout, and oneDNN
reorders it into its blocked layout on every call: a full read and write of the weight beside the
product. A vision tower only ever runs with many rows (an image is hundreds to thousands of
patches), all on oneDNN, so its weights can be reordered once and the reorder skipped from then on;
oneDNN's own call for that is `torch.ops.mkldnn._reorder_linear_weight` (what torch.compile's CPU
freezing pass does with the same op) and `torch.ops.mkldnn._linear_pointwise` runs the product.

Measured on the 2-core Zen 4 machine of docs/benchmarks.md (bf16, 2 threads): Qwen2-VL-2B's vision
shapes [1024, 1280] x [3840 | 5120, 1280] and [1024, 5120] x [1280, 5120] 3-7 % faster, outputs
bit-identical to F.linear's at 4-4096 rows.

The decoder runs few rows (decode) as often as many (prefill). oneDNN's layout for a bf16 weight
turned out to suit a few-row product too: blocks of 64 output rows, each [K / 2][64][2], so one
64-byte load holds 16 outputs' pairs of k for vdpbf16ps and the weights stream in order
(kernels/onednn.py checks the layout per shape before use). vlmserve's kernel on it
(vlm_linear_packed_avx512) was faster than its kernel on the plain layout at every row count up
to 32 (Qwen2-VL-2B's [17920, 1536] at 1 row 0.92 against 1.22 ms, 2 threads, Zen 4), and the
prefill products skip oneDNN's reorder per call (the 2B's decoder at 341 rows ~5 % faster). So the
decoder's weights are reordered too (no second copy), where the AVX-512 kernels are in use (no
path forced) and the shape allows; a weight shared with an embedding (a tied lm_head) stays plain,
as the embedding reads its rows. Reordered weights are oneDNN's memory: they do not move into
the huge-page mapping; models/huge_pages.py collapses the decoder's into huge pages in place.

The reordered weight replaces the layer's parameter (an opaque oneDNN tensor: same shape and dtype,
no data pointer), so the memory stays the same; VLMSERVE_PREPACK=0 keeps the plain weights.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from vlmserve.kernels.dispatch import avx512_kernels, forced_path
from vlmserve.kernels.onednn import (
    ADDRESS_ATTR,
    packed_layout,
    prepack_available,
    prepacked_linear,
    reorder_weight,
    weight_address,
)
from vlmserve.kernels.op import LinearOp
from vlmserve.models.layers import Linear

logger = logging.getLogger(__name__)


def prepacks_vision(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model built for this device and dtype runs its vision tower prepacked: bf16 on the
    CPU, oneDNN's reorder available, and no vlmserve kernel path forced (VLMSERVE_CPU_PATH=avx2 or
    avx512 keep every linear layer on that kernel)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and forced_path() in (None, "torch") and prepack_available()


def packable_decoder_layers(
    model: nn.Module, tower: nn.Module | None, device: torch.device, dtype: torch.dtype
) -> list[Linear]:
    """The Linear layers outside the vision `tower` that prepack_linear_layers(..., packed_linear)
    will reorder: bf16 on the CPU with no kernel path forced and the AVX-512 kernels built, a shape
    whose reordered layout vlmserve's kernel reads (packed_layout), a weight no other module
    shares (a tied lm_head's is the embedding's)."""
    if not (prepacks_vision(device, dtype) and forced_path() is None and avx512_kernels() is not None):
        return []
    skip = set() if tower is None else {id(m) for m in tower.modules()}
    linears = [m for m in model.modules() if isinstance(m, Linear) and id(m) not in skip]
    shared = {id(p) for m in model.modules() if not isinstance(m, Linear) for p in m.parameters(recurse=False)}
    return [
        m
        for m in linears
        if id(m.weight) not in shared
        and m.weight.dtype == torch.bfloat16
        and not m.weight.is_mkldnn
        and packed_layout(*m.weight.shape)
    ]


def prepack_linear_layers(module: nn.Module | list[Linear], op: LinearOp = prepacked_linear) -> int:
    """Reorder the weights of the bf16 CPU Linear layers (of a module, or a list) for oneDNN and
    bind `op` into them; the number of layers reordered. A layer whose reorder fails keeps its
    weight and op."""
    count = 0
    for layer in module.modules() if isinstance(module, nn.Module) else module:
        if not isinstance(layer, Linear):
            continue
        weight = layer.weight
        if weight.is_mkldnn or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            continue
        try:
            packed = reorder_weight(weight.detach())
        except RuntimeError as e:
            logger.warning("oneDNN could not reorder a %s weight (%s); it stays plain", tuple(weight.shape), e)
            continue
        layer.weight = nn.Parameter(packed, requires_grad=False)
        setattr(layer.weight, ADDRESS_ATTR, weight_address(packed))  # for packed_linear, once
        layer.op = op
        count += 1
    return count


def prepacked_layers(model: nn.Module, op: LinearOp = prepacked_linear) -> int:
    """How many of the model's Linear layers run `op` (prepacked_linear: the vision tower's;
    packed_linear: the decoder's)."""
    return sum(1 for m in model.modules() if isinstance(m, Linear) and m.op is op)
