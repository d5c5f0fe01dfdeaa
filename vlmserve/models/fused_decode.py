"""A decode step of the Qwen2 or Qwen3 decoder (Qwen2-VL, Qwen2.5-VL; Qwen3-VL dense) in one C call
on AVX-512 BF16 CPUs.

Why: on the CPU a one-request decode step is bound by reading the weights (3.09 GB a step for
Qwen2-VL-2B in bf16), and the time between the weight products reads almost nothing. Yet in that
time the layer-by-layer path runs ~12 torch ops and ctypes calls a layer, each 10-90 us on the
2-core Zen 4 machine of docs/benchmarks.md (not the 1-20 us they take in a loop on their own: the
93 MB of weights a layer streams past leaves the interpreter's and torch's code and data cold in
every cache): ~16 ms of a ~75 ms step. vlm_decode_step_avx512 (kernels/cpu_linear_avx512.c) runs
the same kernels back to back for every layer and the final norm, so the step gives the same bits.
The two decoders differ, for this kernel, only in Qwen3's per-head q/k RMSNorm before the rotary
(and Qwen3 has no qkv bias); Qwen3-VL-MoE's expert layers are not the kernel's.

Where it applies (enable_fused_decode, at build time): bf16 on a CPU with the AVX-512 kernels and
no other CPU path forced, tensor_parallel_size 1, every decoder product on reordered weights
(models/prepack.py), int8 ones (quantization="int8", the AVX-512 int8 kernel) or 4-bit ones (AWQ and
GPTQ checkpoints kept packed, the AVX-512 int4 kernel), the attention
backend's CPU decode kernel in use, a head_dim the AVX-512 decode attention takes. Per step:
every token a decode row (a decode step: one token per sequence; a verify step: a few tokens
per sequence after cached ones, attention/metadata.py's decode_row_lens), at most FUSED_ROWS
rows, no DeepStack features; any other step runs layer by layer. VLMSERVE_FUSED_DECODE=0
keeps every step layer by layer.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any

import torch
from torch import nn

from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.distributed import tp_size
from vlmserve.kernels.cpu import Avx512Kernels
from vlmserve.kernels.dispatch import avx512_kernels
from vlmserve.kernels.onednn import ADDRESS_ATTR, packed_linear
from vlmserve.models.layers import Linear
from vlmserve.models.quant.int4 import Int4Linear
from vlmserve.models.quant.int8 import Int8Linear

logger = logging.getLogger(__name__)

# The most rows a fused step takes: a verify step of 8 sequences with 8 drafted tokens each. Its
# products run vlm_linear_packed_avx512's loops at any row count; from 33 rows the layer-by-layer
# path runs oneDNN's product instead (kernels/onednn.py: PACKED_ROWS), about as fast at 40-72 rows
# on the Zen 4 machine of docs/benchmarks.md, but with ~16 ms of a step between the products:
# fused, the 2B's verify step of 8 sequences x 5 or 9 rows took 0.83-0.85 of the layer-by-layer
# one there (4 alternating rounds, under load).
# NOTE: so from 33 rows the two paths' sums run in different orders: the fused step's rows are
# each a decode step's bits (rows are independent in its kernels), not the layer path's.
FUSED_ROWS = 72


def _packed_address(linear: nn.Module) -> int | None:
    if isinstance(linear, Linear) and linear.op is packed_linear:
        return getattr(linear.weight, ADDRESS_ATTR, None)
    return None


def _int8_product(linear: nn.Module) -> int | None:
    """vlm_linear_int8_avx512's address where an Int8Linear's decode runs it (its collective, a
    row-parallel layer's, is the identity at the tensor_parallel_size 1 build requires)."""
    if isinstance(linear, Int8Linear):
        kernel = linear.kernel
        if kernel is not None and kernel.decode and kernel.avx512 is not None:
            return kernel.avx512.product_address
    return None


def _int4_product(linear: nn.Module) -> int | None:
    """vlm_linear_int4_avx512's address where an Int4Linear's decode runs it."""
    if isinstance(linear, Int4Linear) and linear.kernel.decode:
        return linear.kernel.avx512_address
    return None


def _product_fields(linear: nn.Module, keep: list[torch.Tensor]) -> list[int] | None:
    """The four fields vlm_decode_step_avx512 reads for a product (see there), None where the
    layer no longer runs one of its products (its op rebound since the build); `keep` holds the
    tensors made for it (a quantized layer's bias in fp32, as its own path passes it; an int4
    layer's descriptor, which stands where the weights' address does)."""
    address = _packed_address(linear)
    if isinstance(linear, Linear) and address is not None:
        return [0, address, 0, 0 if linear.bias is None else linear.bias.data_ptr()]
    int4 = _int4_product(linear)
    if isinstance(linear, Int4Linear) and int4 is not None:
        desc = linear.desc()
        keep.append(desc)
        bias = None if linear.bias is None else linear.bias.float()
        if bias is not None:
            keep.append(bias)
        return [int4, desc.data_ptr(), 0, 0 if bias is None else bias.data_ptr()]
    product = _int8_product(linear)
    if not isinstance(linear, Int8Linear) or product is None:
        return None
    bias32 = None if linear.bias is None else linear.bias.float()
    if bias32 is not None:
        keep.append(bias32)
    return [product, linear.qweight.data_ptr(), linear.scales.data_ptr(), 0 if bias32 is None else bias32.data_ptr()]


class FusedDecode:
    """The model's decoder as vlm_decode_step_avx512 reads it: built by `build` where it applies."""

    def __init__(self, model: Any, layers: list[Any], kernels: Avx512Kernels, eps: float) -> None:
        self.model = model
        self.layers = layers
        self.kernels = kernels
        self.eps = eps
        first = layers[0]
        self.num_heads = first.self_attn.num_heads
        self.scale = first.self_attn.attn.scale
        self.intermediate_size = first.mlp.down_proj.in_features  # a Linear or an Int8Linear
        # The address table, built on the first step (after the engine binds the KV caches and
        # moves the weights onto huge pages) and again if the caches are bound anew; a step whose
        # table cannot be built (a product's op rebound before it was) runs layer by layer.
        self._caches: list[torch.Tensor] = []
        self._table: torch.Tensor | None = None
        self._keep: list[torch.Tensor] = []

    @classmethod
    def build(cls, model: Any, kinds: tuple[type[nn.Module], ...]) -> FusedDecode | None:
        """For a decoder model (layers, norm) whose layers, their attention and MLP are exactly
        `kinds` (the families' QwenDecoderLayer, QwenAttention, QwenMLP: passed in, as models/
        names no family); None where the fused kernel does not apply."""
        layer_kind, attention_kind, mlp_kind = kinds
        if os.environ.get("VLMSERVE_FUSED_DECODE", "1") == "0" or tp_size() != 1:
            return None
        kernels = avx512_kernels()
        layers: list[Any] = list(model.layers)
        if kernels is None or not layers:
            return None
        eps = model.norm.eps
        if model.norm.weight.dtype != torch.bfloat16 or not model.norm.weight.is_contiguous():
            return None
        for layer in layers:
            if not (
                type(layer) is layer_kind
                and type(layer.self_attn) is attention_kind
                and type(layer.mlp) is mlp_kind
                and _applies(layer, eps)
            ):
                return None
        return cls(model, layers, kernels, eps)

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """The final norm's output [M, H] (the rows of meta.output_rows where set) for a step of
        M <= FUSED_ROWS tokens that all run as decode rows (a decode step, or a verify step's
        k + 1 tokens per sequence: attention/metadata.py); None for any other step (the caller
        runs it layer by layer)."""
        m = x.shape[0]
        if not 0 < m <= FUSED_ROWS or x.dtype != torch.bfloat16 or cos.dtype != torch.bfloat16:
            return None
        if meta.num_seqs == m:  # a decode step: the sequences' own block tables and lengths
            if meta.query_start_loc[-1] != m or min(meta.seq_lens_host) < 2:
                return None
            tables, seq_lens = meta.block_tables, meta.seq_lens
        else:
            # NOTE: the kernel writes every row's K/V in a layer before any row attends, so row j
            # of a sequence sees its k + 1 tokens' first j + 1 as a decode step of them would.
            lens = meta.decode_row_lens()
            if lens is None:
                return None
            q_lens = torch.tensor([b - a for a, b in itertools.pairwise(meta.query_start_loc)])
            tables = meta.block_tables.repeat_interleave(q_lens.to(meta.block_tables.device), dim=0)
            seq_lens = torch.tensor(lens, dtype=torch.int64)
        table = self._addresses()
        if table is None:
            return None
        out = self.kernels.decode_step(
            x.contiguous().clone(),  # the kernel writes the residual stream into it
            table,
            self.model.norm.weight,
            cos.contiguous(),
            sin.contiguous(),
            meta.slot_mapping.to(torch.int64).contiguous(),
            tables.to(torch.int64).contiguous(),
            seq_lens.to(torch.int64).contiguous(),
            tuple(self._caches[0].shape),
            self.num_heads,
            self.intermediate_size,
            self.eps,
            self.scale,
        )
        if out is None:
            logger.warning("the fused decode kernel declined this model's shapes; decoding layer by layer")
            self.model.fused_decode = None
            return None
        # Rows are independent through every kernel: the kept rows' bits are those the layer by
        # layer path computes for them alone in the last layer.
        return out if meta.output_rows is None else out[meta.output_rows]

    def _addresses(self) -> torch.Tensor | None:
        bound = [layer.self_attn.attn.kv_cache for layer in self.layers]
        if len(bound) == len(self._caches) and all(a is b for a, b in zip(bound, self._caches, strict=True)):
            return self._table
        caches = [c for c in bound if c is not None and c.is_contiguous() and c.dtype == torch.bfloat16]
        if len(caches) != len(bound) or any(c.shape != caches[0].shape for c in caches):
            return None
        rows: list[list[int]] = []
        keep: list[torch.Tensor] = []
        for layer, cache in zip(self.layers, caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            row = [layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr()]
            row += [cache.data_ptr(), *(n.weight.data_ptr() if n is not None else 0 for n in _qk_norms(attn))]
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                fields = _product_fields(linear, keep)
                if fields is None:
                    return None
                row += fields
            rows.append(row)
        self._keep = keep
        self._caches = caches
        self._table = torch.tensor(rows, dtype=torch.int64)
        return self._table


def _qk_norms(attention: nn.Module) -> tuple[Any, Any]:
    """A Qwen3 attention's q_norm and k_norm (RMSNorm over each head); (None, None) in Qwen2's."""
    return getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)


def _applies(layer: Any, eps: float) -> bool:
    """Whether the fused kernel computes this layer as its modules do: each product on reordered
    bf16 weights (models/prepack.py) or int8 ones with the AVX-512 decode kernel; Qwen3's q/k
    norms as RMSNorm.heads_ computes them (bf16, the decoder's eps)."""
    attn, mlp = layer.self_attn, layer.mlp
    head_dim = attn.head_dim
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    backend = attn.attn.backend
    q_norm, k_norm = _qk_norms(attn)
    if (q_norm is None) != (k_norm is None):
        return False
    head_norms = () if q_norm is None else (q_norm, k_norm)
    if any(n.weight.shape != (head_dim,) for n in head_norms):
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm, *head_norms)
    qkv_bias = attn.qkv_proj.bias
    return (
        all(any(f(linear) is not None for f in (_packed_address, _int8_product, _int4_product)) for linear in linears)
        and all(linear.bias is None for linear in linears[1:])
        and (qkv_bias is None or qkv_bias.dtype == torch.bfloat16)
        and all(n.weight.dtype == torch.bfloat16 and n.weight.is_contiguous() and n.eps == eps for n in norms)
        and getattr(backend, "decode_kernel", None) is not None
        and head_dim % 32 == 0
        and head_dim <= 256
        and attn.num_heads % attn.num_kv_heads == 0
        and attn.num_heads // attn.num_kv_heads <= 16
    )
