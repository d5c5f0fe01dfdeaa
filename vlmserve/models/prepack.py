"""The vision towers' linear layers on oneDNN with their weights reordered once, at build time.

torch's bf16 `linear` on the CPU hands oneDNN the weight in its plain [out, in] layout, and oneDNN
reorders it into its blocked layout on every call: a full read and write of the weight beside the
product. A vision tower only ever runs with many rows (an image is hundreds to thousands of
patches), all on oneDNN, so its weights can be reordered once and the reorder skipped from then on;
oneDNN's own call for that is `torch.ops.mkldnn._reorder_linear_weight` (what torch.compile's CPU
freezing pass does with the same op) and `torch.ops.mkldnn._linear_pointwise` runs the product.

Measured on the 2-core Zen 4 machine of docs/benchmarks.md (bf16, 2 threads): Qwen2-VL-2B's vision
shapes [1024, 1280] x [3840 | 5120, 1280] and [1024, 5120] x [1280, 5120] 3-7 % faster, outputs
bit-identical to F.linear's at 4-4096 rows. The decoder's weights stay plain: its decode steps
(1-32 rows) run vlmserve's own kernels, which read that layout, and a second, reordered copy would
double the weights' memory.

The reordered weight replaces the layer's parameter (an opaque oneDNN tensor: same shape and dtype,
no data pointer), so the memory stays the same; VLMSERVE_PREPACK=0 keeps the plain weights.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from vlmserve.kernels.dispatch import forced_path
from vlmserve.kernels.onednn import prepack_available, prepacked_linear, reorder_weight
from vlmserve.models.layers import Linear

logger = logging.getLogger(__name__)


def prepacks_vision(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model built for this device and dtype runs its vision tower prepacked: bf16 on the
    CPU, oneDNN's reorder available, and no vlmserve kernel path forced (VLMSERVE_CPU_PATH=avx2 or
    avx512 keep every linear layer on that kernel)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and forced_path() in (None, "torch") and prepack_available()


def prepack_linear_layers(module: nn.Module) -> int:
    """Reorder the weights of module's bf16 CPU Linear layers for oneDNN and bind prepacked_linear
    into them; the number of layers reordered. A layer whose reorder fails keeps its weight and op."""
    count = 0
    for layer in module.modules():
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
        layer.op = prepacked_linear
        count += 1
    return count


def prepacked_layers(model: nn.Module) -> int:
    """How many of the model's Linear layers run prepacked_linear."""
    return sum(1 for m in model.modules() if isinstance(m, Linear) and m.op is prepacked_linear)
