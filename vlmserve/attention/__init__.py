"""Attention seam: metadata passed as an argument, a backend chosen once when the engine is built."""

from __future__ import annotations

import os
from typing import Protocol

import torch

from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.attention.torch_backend import DecodeKernel, PrefillKernel, TorchAttentionBackend


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


BACKENDS = ("auto", "torch", "triton")


def select_backend(device: torch.device, name: str = "auto", decode_workspace_tokens: int = 32768) -> AttentionBackend:
    """Called once when the engine is built. "auto": triton on CUDA where the package is
    installed, torch elsewhere. The torch backend runs on every device; on CPUs where the
    vlmserve kernels build, its decode steps read the paged KV in place, and with AVX-512 BF16
    its prefill and vision attention run a flash kernel of ours. The triton backend runs
    on CUDA, and on the CPU only under the Triton interpreter (TRITON_INTERPRET=1: tests)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto" and device.type == "cuda" and _triton_installed():
        name = "triton"
    if name == "triton":
        if not _triton_installed():
            raise ValueError("attention backend 'triton' needs the triton package: pip install triton")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"attention backend 'triton' runs on CUDA devices, not {device.type} "
                "(on the CPU only under the Triton interpreter, TRITON_INTERPRET=1, for tests)"
            )
        from vlmserve.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if device.type != "cpu":
        return TorchAttentionBackend(decode_workspace_tokens)
    return TorchAttentionBackend(decode_workspace_tokens, _cpu_decode_kernel(), _cpu_prefill_kernel())


def _cpu_decode_kernel() -> DecodeKernel | None:
    """The vlmserve decode attention kernel for this CPU: the AVX-512 BF16 one where the CPU has it
    and it applies (bf16, head_dim a multiple of 32), unless VLMSERVE_CPU_PATH forces the avx2 or
    torch path; the AVX2 one otherwise; None where the kernels do not build."""
    from vlmserve.kernels.cpu import load_cpu_kernels
    from vlmserve.kernels.dispatch import avx512_kernels

    kernels = load_cpu_kernels()
    if kernels is None:
        return None
    avx512 = avx512_kernels()
    if avx512 is None:
        return kernels.decode_attention
    fast, general = avx512.decode_attention, kernels.decode_attention

    def decode(
        q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float
    ) -> torch.Tensor | None:
        out = fast(q, kv_cache, tables, lens, scale)
        return out if out is not None else general(q, kv_cache, tables, lens, scale)

    return decode


def _cpu_prefill_kernel() -> PrefillKernel | None:
    """The AVX-512 BF16 flash kernel for prefill and vision attention where the CPU has it (torch's
    SDPA where it declines: not bf16, odd head_dim), unless VLMSERVE_CPU_PATH forces the avx2 or
    torch path; None otherwise (SDPA)."""
    from vlmserve.kernels.dispatch import avx512_kernels

    avx512 = avx512_kernels()
    return None if avx512 is None else avx512.prefill_attention


def _triton_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "select_backend"]
