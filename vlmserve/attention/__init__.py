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
    """Called once when the engine is built. The torch backend runs on every device; on CPUs
    where the vlmserve kernels build, its decode steps read the paged KV in place."""
    if name not in ("auto", "torch"):
        raise ValueError(f"unknown attention backend {name!r}; available: torch")
    decode_kernel = None
    if device.type == "cpu":
        from vlmserve.kernels.cpu import load_cpu_kernels

        kernels = load_cpu_kernels()
        decode_kernel = kernels.decode_attention if kernels is not None else None
    return TorchAttentionBackend(decode_workspace_tokens, decode_kernel)


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "select_backend"]
