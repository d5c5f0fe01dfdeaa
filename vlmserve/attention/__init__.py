"""Attention seam: metadata passed as an argument, a backend chosen once when the engine is built."""

from __future__ import annotations

from typing import Protocol

import torch

from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.attention.torch_backend import TorchAttentionBackend


class AttentionBackend(Protocol):
    name: str

    def paged_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...

    def varlen_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int], scale: float
    ) -> torch.Tensor: ...


def select_backend(device: torch.device, name: str = "auto", decode_workspace_tokens: int = 32768) -> AttentionBackend:
    """Called once when the engine is built. Only the torch backend exists so far; it runs on
    every device."""
    if name not in ("auto", "torch"):
        raise ValueError(f"unknown attention backend {name!r}; available: torch")
    return TorchAttentionBackend(decode_workspace_tokens)


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "select_backend"]
