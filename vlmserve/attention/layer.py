"""The language model's attention op: delegates to the backend chosen at engine build time and
reads/writes the paged KV cache bound to this layer."""

from __future__ import annotations

import torch
from torch import nn

from vlmserve.attention import AttentionBackend
from vlmserve.attention.metadata import AttentionMetadata


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        # [2, num_blocks, block_size, num_kv_heads, head_dim], bound by the engine once allocated.
        self.kv_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert self.kv_cache is not None, "KV cache not bound: the engine allocates it before the first step"
        out = self.backend.paged_attention(q, k, v, self.kv_cache, meta, self.scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
