"""The AVX-512 BF16 flash kernel for prefill and vision attention (cpu_linear_avx512.c,
Avx512Kernels.prefill_attention) against an fp64 reference, and against torch's SDPA on the same
bf16 inputs; and the attention backend using it. Skipped where the CPU has no AVX-512 BF16."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from vlmserve.attention.torch_backend import TorchAttentionBackend
from vlmserve.kernels import cpu
from vlmserve.kernels.cpu import prefill_kernel_applies

avx512 = cpu.load_avx512_kernels()
needs_avx512 = pytest.mark.skipif(avx512 is None, reason="this CPU has no AVX-512 BF16 (or the kernel did not build)")

SHAPES = [  # (q_len, kv_len, heads, kv_heads, head_dim, causal_offset)
    (200, 200, 16, 16, 80, None),  # Qwen2-VL's vision tower: a block of 128 keys and a part
    (300, 300, 16, 16, 80, None),  # two blocks and a part
    (130, 130, 12, 2, 128, 0),  # Qwen2-VL-2B's prefill: causal, six query heads per KV head
    (37, 300, 4, 2, 64, 263),  # a prefill chunk over 263 cached tokens
    (16, 140, 4, 2, 64, 124),  # a chunk whose first rows see none of the second block's keys
    (70, 70, 16, 16, 72, None),  # Qwen3-VL's vision tower: head_dim not a multiple of 16
    (70, 70, 16, 16, 104, None),  # Qwen-VL's
    (9, 9, 4, 2, 16, 0),  # the tiny test checkpoint
    (65, 65, 2, 2, 256, 0),  # the largest head_dim
    (1, 1, 2, 1, 32, 0),  # one token
]


def inputs(q_len: int, kv_len: int, heads: int, kv_heads: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v as the models make them: views of fused projections (rows strided); peaked softmax."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(q_len, heads + 2 * kv_heads, dim, generator=g).bfloat16()
    kv = (2 * torch.randn(kv_len, 2 * kv_heads, dim, generator=g)).bfloat16()
    return qkv[:, :heads], kv[:, :kv_heads], kv[:, kv_heads:]


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 attention, query head h on KV head h // (heads / kv_heads); and, per (query, head), the
    largest |value| it attends over."""
    group = q.shape[1] // k.shape[1]
    kd, vd = (t.double().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))  # [heads, kv_len, dim]
    scores = q.double().transpose(0, 1) @ kd.transpose(1, 2) * scale  # [heads, q_len, kv_len]
    seen = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool)
    if causal_offset is not None:
        seen = torch.arange(k.shape[0])[None, :] <= torch.arange(q.shape[0])[:, None] + causal_offset
    out = scores.masked_fill(~seen, float("-inf")).softmax(-1) @ vd
    largest = (vd.abs().amax(-1)[:, None, :] * seen).amax(-1)  # [heads, q_len]
    return out.transpose(0, 1), largest.transpose(0, 1)[..., None]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int | None) -> torch.Tensor:
    mask = None
    if causal_offset is not None:
        mask = torch.arange(k.shape[0])[None, :] <= torch.arange(q.shape[0])[:, None] + causal_offset
    o = F.scaled_dot_product_attention(
        *(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return o[0].transpose(0, 1)


@needs_avx512
@pytest.mark.parametrize(("q_len", "kv_len", "heads", "kv_heads", "dim", "causal_offset"), SHAPES)
def test_matches_fp64_reference_as_closely_as_sdpa(
    q_len: int, kv_len: int, heads: int, kv_heads: int, dim: int, causal_offset: int | None
) -> None:
    assert avx512 is not None
    q, k, v = inputs(q_len, kv_len, heads, kv_heads, dim, seed=dim + q_len)
    scale = dim**-0.5
    out = avx512.prefill_attention(q, k, v, scale, causal_offset)
    assert out is not None and out.dtype == torch.bfloat16 and out.shape == q.shape
    ref, largest = reference(q, k, v, scale, causal_offset)
    # The kernel rounds each probability to bf16 for the product with V (as torch's flash kernel):
    # within half a bf16 step, 2^-8 of itself, so the weighted sum moves by at most 2^-8 of the
    # largest |value| attended; the output is rounded once more (2^-8 |out|); fp32 sums add ~1e-5.
    error = (out.double() - ref).abs()
    assert (error <= 2.0**-8 * (ref.abs() + largest) * 1.01 + 1e-5 * largest).all()
    # And no further from the reference than torch's SDPA on the same bf16 inputs (the same
    # arithmetic in another order): a key seen that should not be, or one missed, shows up here
    # long before it breaks the bound above.
    assert error.mean() <= 1.1 * (sdpa(q, k, v, scale, causal_offset).double() - ref).abs().mean() + 1e-6
    if causal_offset == 0:  # the first query sees the first key only: its value, exactly
        group = heads // kv_heads
        assert torch.equal(out[0], v[0].repeat_interleave(group, dim=0))


@needs_avx512
def test_declines_what_it_does_not_take() -> None:
    assert avx512 is not None
    q, k, v = inputs(8, 8, 4, 2, 16, seed=0)
    assert prefill_kernel_applies(q, k, v)
    assert avx512.prefill_attention(q.float(), k.float(), v.float(), 0.25, 0) is None  # bf16 only
    q3, k3, v3 = inputs(8, 8, 4, 2, 258, seed=0)  # past the per-thread buffers
    assert avx512.prefill_attention(q3, k3, v3, 0.25, None) is None
    q5, k5, v5 = inputs(8, 8, 4, 2, 15, seed=0)  # odd head_dim: dims are taken in pairs
    assert avx512.prefill_attention(q5, k5, v5, 0.25, None) is None
    assert not prefill_kernel_applies(q, k.transpose(0, 1).contiguous().transpose(0, 1), v)  # heads not side by side
    assert not prefill_kernel_applies(torch.empty(6, 3, 16, dtype=torch.bfloat16), k, v)  # 3 heads on 2 KV heads
    assert not prefill_kernel_applies(q[:0], k, v)


@needs_avx512
def test_the_backend_runs_vision_segments_and_prefill_chunks_through_the_kernel() -> None:
    assert avx512 is not None
    calls: list[int | None] = []

    def kernel(*args: object) -> torch.Tensor | None:
        assert avx512 is not None
        calls.append(args[-1])  # type: ignore[arg-type]
        return avx512.prefill_attention(*args)  # type: ignore[arg-type]

    backend, plain = TorchAttentionBackend(prefill_kernel=kernel), TorchAttentionBackend()
    # Segments as the vision tower makes them; each attends within itself only.
    q, k, v = inputs(196, 196, 4, 4, 80, seed=5)
    cu_seqlens = [0, 1, 66, 196]
    got = backend.varlen_attention(q, k, v, cu_seqlens, 80**-0.5)
    assert calls == [None, None, None]
    for start, end in itertools.pairwise(cu_seqlens):
        ref, largest = reference(q[start:end], k[start:end], v[start:end], 80**-0.5, None)
        assert ((got[start:end].double() - ref).abs() <= 2.0**-8 * (ref.abs() + largest) * 1.01 + 1e-5).all()
    expected = plain.varlen_attention(q, k, v, cu_seqlens, 80**-0.5)  # SDPA
    assert (got.float() - expected.float()).abs().max() < 0.05
    # A prefill chunk over earlier tokens: query i at position 263 + i.
    calls.clear()
    q, k, v = inputs(37, 300, 4, 2, 64, seed=6)
    got = backend._attend(q, k, v, 0.125, causal_offset=263)
    assert calls == [263]
    ref, largest = reference(q, k, v, 0.125, 263)
    assert ((got.double() - ref).abs() <= 2.0**-8 * (ref.abs() + largest) * 1.01 + 1e-5).all()
