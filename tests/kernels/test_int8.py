"""The int8 weight-only products (kernels/int8.py, cpu_int8.c) against references written here."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.guard import before_guard_page
from tests.kernels.test_cpu import CANNOT_BUILD
from vlmserve.kernels import cpu, int8
from vlmserve.kernels.int8 import (
    KERNEL_MAX_ROWS,
    KERNEL_MAX_ROWS_AVX512,
    Int8Kernel,
    dequantize_int8,
    int8_linear,
    load_int8_kernel,
)

kernel = load_int8_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason=f"no compiled int8 kernel: {CANNOT_BUILD or 'build failed'}")


def _case(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01 + 1e-4
    bias = torch.randn(n, generator=g)
    return x, q, scale, bias


def test_int8_kernel_builds_where_the_cpu_kernels_do() -> None:
    if CANNOT_BUILD is not None:
        pytest.skip(f"the CPU kernels cannot be built here: {CANNOT_BUILD}")
    assert kernel is not None


@needs_kernel
@pytest.mark.parametrize(("m", "n", "k"), [(1, 7, 13), (1, 4099, 1536), (2, 9, 64), (3, 16, 40), (5, 33, 8)])
def test_kernel_matches_float_product_of_dequantized_weights(m: int, n: int, k: int) -> None:
    assert kernel is not None
    x, q, scale, bias = _case(m, n, k)
    expected = F.linear(x.double(), q.double() * scale.double()[:, None], bias.double())
    for b in (None, bias):
        got = kernel.linear(x, q, scale, b)
        want = expected if b is not None else expected - bias.double()
        # fp32 accumulation of k products: relative to the size of the terms summed
        bound = 1e-6 * k * (x.abs().double() @ (q.double().abs() * scale.double()[:, None]).T) + 1e-6
        assert ((got.double() - want).abs() <= bound).all()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_dequantization_is_exact(dtype: torch.dtype) -> None:
    assert kernel is not None
    _, q, scale, _ = _case(1, 37, 203, seed=1)  # tails in both dimensions
    expected = (q.float() * scale[:, None]).to(dtype)  # one fp32 product, rounded once (nearest even)
    assert torch.equal(kernel.dequantize(q, scale, dtype), expected)
    assert torch.equal(dequantize_int8(q, scale, dtype, None), expected)


@pytest.mark.parametrize("rows", [1, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 40])
@pytest.mark.parametrize("with_kernel", [True, False])
def test_int8_linear_on_both_paths_keeps_shape_dtype_and_values(
    rows: int, with_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if with_kernel and kernel is None:
        pytest.skip("no compiled int8 kernel")
    monkeypatch.setattr(int8, "DEQUANT_ROWS", 8)  # the chunked dequantization, on a small matrix
    x, q, scale, bias = _case(rows, 21, 48, seed=2)
    x3 = x.reshape(1, rows, 48).bfloat16()
    got = int8_linear(x3, q, scale, bias.bfloat16(), kernel if with_kernel else None)
    assert got.shape == (1, rows, 21) and got.dtype == torch.bfloat16
    weight = dequantize_int8(q, scale, torch.bfloat16).float()
    expected = F.linear(x3.float(), weight, bias.bfloat16().float())
    # bf16 output rounding (the kernel path keeps the weights in fp32, the GEMM path rounds them to bf16)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


# -- the AVX-512 BF16 decode kernel (cpu_int8_avx512.c) and the path choice ---------------------------

avx512 = kernel.avx512 if kernel is not None else None
needs_avx512 = pytest.mark.skipif(
    avx512 is None,
    reason="no AVX-512 BF16 int8 kernel: "
    + ("this CPU lacks AVX-512 F/BW/BF16" if not cpu._cpu_has_avx512_bf16() else "it did not build, or no AVX2 kernel"),
)


def test_avx512_int8_kernel_builds_where_the_cpu_has_avx512_bf16() -> None:
    if CANNOT_BUILD is not None or not cpu._cpu_has_avx512_bf16() or os.environ.get("VLMSERVE_CPU_PATH"):
        pytest.skip("this machine cannot have it (no AVX-512 BF16, no compiler, or a path forced)")
    assert avx512 is not None


@needs_avx512
@pytest.mark.parametrize(("n", "k"), [(7, 13), (33, 97), (1027, 200), (9, 64), (130, 1537)])
def test_avx512_int8_kernel_matches_the_float_product_of_dequantized_weights(n: int, k: int) -> None:
    assert avx512 is not None
    for m in (1, 2, 3, 4, 5, 9, 31, 40):
        x, q, scale, bias = _case(m, n, k, seed=n + m)
        xb = x.bfloat16()  # the kernel's input: bf16 activations, exact in fp32 / fp64 below
        expected = F.linear(xb.double(), q.double() * scale.double()[:, None], bias.double())
        bound = 1e-6 * k * (xb.abs().double() @ (q.double().abs() * scale.double()[:, None]).T) + 1e-6
        for b in (None, bias):
            got = avx512.linear(xb, q, scale, b)
            want = expected if b is not None else expected - bias.double()
            assert got.dtype == torch.float32 and got.shape == (m, n)
            assert ((got.double() - want).abs() <= bound).all()
            # bf16 out: the same fp32 results, each rounded once as torch rounds them
            rounded = avx512.linear(xb, q, scale, b, out_dtype=torch.bfloat16)
            assert rounded.dtype == torch.bfloat16
            assert torch.equal(rounded, got.bfloat16())


@needs_avx512
@pytest.mark.parametrize("rows", [1, 5])
def test_avx512_int8_kernel_reads_nothing_past_the_weights(rows: int) -> None:
    assert avx512 is not None
    x, q, scale, _ = _case(rows, 9, 45)
    q = before_guard_page(q)  # a partial 32-wide chunk at the very end
    expected = F.linear(x.bfloat16().double(), q.double() * scale.double()[:, None])
    torch.testing.assert_close(avx512.linear(x.bfloat16(), q, scale, None).double(), expected)


class FakePath:
    def __init__(self, name: str, calls: list[tuple[str, torch.dtype]]) -> None:
        self.name, self.calls = name, calls

    def linear(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        scale: torch.Tensor,
        b: torch.Tensor | None,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        self.calls.append((self.name, x.dtype))
        return torch.zeros(x.shape[0], q.shape[0], dtype=out_dtype)


def test_int8_linear_takes_avx512_for_bf16_and_avx2_for_fp32_activations() -> None:
    calls: list[tuple[str, torch.dtype]] = []
    fake = Int8Kernel.__new__(Int8Kernel)  # no library: both products recorded, dequantizing by torch
    fake.linear = FakePath("avx2", calls).linear  # type: ignore[method-assign]
    fake.avx512 = FakePath("avx512", calls)  # type: ignore[assignment]
    fake.dequantize = lambda q, s, dtype: (q.float() * s[:, None]).to(dtype)  # type: ignore[method-assign]
    x, q, scale, bias = _case(3, 21, 48)
    int8_linear(x.bfloat16(), q, scale, bias.bfloat16(), fake)
    int8_linear(x, q, scale, bias, fake)
    int8_linear(torch.randn(72, 48).bfloat16(), q, scale, None, fake)  # a verify step of 8 x 9 rows
    int8_linear(torch.randn(KERNEL_MAX_ROWS_AVX512 + 1, 48).bfloat16(), q, scale, None, fake)  # prefill: dequantized
    int8_linear(torch.randn(KERNEL_MAX_ROWS + 1, 48), q, scale, None, fake)  # past the AVX2 kernel's rows: dequantized
    assert calls == [("avx512", torch.bfloat16), ("avx2", torch.float32), ("avx512", torch.bfloat16)]
    fake.decode = False  # VLMSERVE_CPU_PATH=torch
    int8_linear(x.bfloat16(), q, scale, None, fake)
    assert len(calls) == 3


@pytest.fixture
def fresh_int8(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """load_int8_kernel un-cached, reading a fake /proc/cpuinfo (this machine's, unless rewritten)."""
    fake = tmp_path / "cpuinfo"
    fake.write_text(Path("/proc/cpuinfo").read_text())
    monkeypatch.setattr(cpu, "CPUINFO", fake)
    monkeypatch.delenv("VLMSERVE_CPU_PATH", raising=False)
    monkeypatch.delenv("VLMSERVE_CPU_KERNELS", raising=False)
    load_int8_kernel.cache_clear()
    yield fake
    load_int8_kernel.cache_clear()


@needs_avx512
def test_the_cpu_path_variable_picks_the_int8_decode_path(fresh_int8: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def loaded(path: str | None) -> Int8Kernel:
        if path is None:
            monkeypatch.delenv("VLMSERVE_CPU_PATH", raising=False)
        else:
            monkeypatch.setenv("VLMSERVE_CPU_PATH", path)
        load_int8_kernel.cache_clear()
        k = load_int8_kernel()
        assert k is not None
        return k

    auto = loaded(None)
    assert auto.decode and auto.avx512 is not None and "AVX-512" in auto.describe()
    assert loaded("avx512").avx512 is not None
    avx2 = loaded("avx2")
    assert avx2.decode and avx2.avx512 is None and "cpu_int8.c (AVX2)" in avx2.describe()
    torch_path = loaded("torch")
    assert not torch_path.decode and "dequantize per call" in torch_path.describe()
    x, q, scale, _ = _case(2, 21, 48)
    got = int8_linear(x.bfloat16(), q, scale, None, torch_path)  # decode rows, yet dequantized
    expected = F.linear(x.bfloat16(), dequantize_int8(q, scale, torch.bfloat16))
    assert torch.equal(got, expected)
    fresh_int8.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c\n")  # AVX-512 disabled
    assert loaded(None).avx512 is None and loaded("avx512").avx512 is None
