"""The CPU bf16 linear kernel does torch's bf16 arithmetic: exact widening, fp32 accumulation,
one round-to-nearest-even."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlmserve.kernels import select_linear_op
from vlmserve.kernels.cpu import GEMM_ROWS, load_cpu_kernels

kernels = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="CPU without AVX2/FMA/F16C or no C compiler")


@needs_kernels
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 7, 13),
        (1, 4099, 1536),
        (2, 33, 64),
        (3, 130, 1176),
        (17, 64, 200),
        (GEMM_ROWS - 1, 50, 96),
        (GEMM_ROWS, 50, 96),
        (300, 40, 72),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_fp32_reference_rounded_once(m: int, n: int, k: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if with_bias else None
    reference = F.linear(x.float(), w.float(), None if b is None else b.float())
    out = kernels.linear_bf16(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # Only the summation order differs from the fp32 reference: at most one bf16 step apart.
    ulp = reference.abs().clamp(min=1e-3) * 2.0**-7
    assert ((out.float() - reference).abs() <= ulp).all()
    assert (out.float() == reference.bfloat16().float()).float().mean() > 0.99


@needs_kernels
def test_leading_dims_and_non_contiguous_inputs() -> None:
    x = torch.randn(2, 3, 16, 40).bfloat16()[..., ::2]  # [2, 3, 16, 20], strided
    w = torch.randn(24, 20).bfloat16()
    out = kernels.linear_bf16(x, w, None)
    assert out.shape == (2, 3, 16, 24)
    assert torch.allclose(out.float(), F.linear(x.float(), w.float()), rtol=2**-7, atol=1e-2)


@needs_kernels
def test_widen_is_exact() -> None:
    t = torch.randn(1000, 37).bfloat16()
    assert torch.equal(kernels.widen(t), t.float())


def test_selection_is_made_per_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    assert select_linear_op(torch.device("cpu"), torch.float32) is F.linear
    if kernels is not None:
        assert select_linear_op(torch.device("cpu"), torch.bfloat16) == kernels.linear_bf16
    monkeypatch.setenv("VLMSERVE_CPU_KERNELS", "0")
    load_cpu_kernels.cache_clear()
    try:
        assert select_linear_op(torch.device("cpu"), torch.bfloat16) is F.linear
    finally:
        monkeypatch.delenv("VLMSERVE_CPU_KERNELS")
        load_cpu_kernels.cache_clear()
