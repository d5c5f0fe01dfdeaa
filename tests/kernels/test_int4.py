"""The 4-bit products and dequantization (kernels/int4.py, cpu_int4.c, cpu_int4_avx512.c) against
references written here: the blocked layout is packed below from its description in cpu_int4.c,
independently of models/quant's packing."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.kernels.test_cpu import CANNOT_BUILD
from vlmserve.kernels import cpu, int4
from vlmserve.kernels.int4 import KERNEL_MAX_ROWS, Int4Kernel, int4_linear, load_int4_kernel

kernel = load_int4_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason=f"no compiled int4 kernel: {CANNOT_BUILD or 'build failed'}")
needs_avx512 = pytest.mark.skipif(
    kernel is None or not kernel.has_avx512, reason="no AVX-512 BF16 int4 kernel (this CPU lacks it, or no build)"
)


class Layer:
    """A random 4-bit layer: its integers, scales, zeros, the float64 weight they stand for, and
    the blocked layout with its `desc` (the tensors kept alive with it)."""

    def __init__(self, n: int, k: int, group: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        groups = k // group
        self.q = torch.randint(0, 16, (n, k), generator=g)
        self.zeros = torch.randint(0, 16, (n, groups), generator=g).float()
        self.scales = (torch.rand(n, groups, generator=g) * 0.02 + 0.005).half().float()  # fp16 as published
        per_input = torch.arange(k) // group
        self.weight = (self.q.double() - self.zeros.double()[:, per_input]) * self.scales.double()[:, per_input]
        blocks = -(-n // 16)
        q = np.zeros((blocks * 16, k), dtype=np.uint32)
        q[:n] = self.q.numpy()
        # [blocks, 16 outputs, K / 8, 8 inputs] -> [blocks, K / 8, 16, 8]: input i of an octet goes to
        # bits 4 (i // 2) (even i) or 16 + 4 (i // 2) (odd i) of its output's word
        q = q.reshape(blocks, 16, k // 8, 8).transpose(0, 2, 1, 3)
        words = np.zeros((blocks, k // 8, 16), dtype=np.uint32)
        for i in range(8):
            words |= q[..., i] << np.uint32(4 * (i // 2) + 16 * (i % 2))
        self.qweight = torch.from_numpy(words.view(np.int32).copy())
        params = np.zeros((blocks, groups, 2, 16), dtype=np.float32)
        for n_ in range(n):
            params[n_ // 16, :, 0, n_ % 16] = self.scales[n_].numpy()
            params[n_ // 16, :, 1, n_ % 16] = self.zeros[n_].numpy()
        self.params = torch.from_numpy(params)
        self.desc = torch.tensor([self.qweight.data_ptr(), self.params.data_ptr(), group], dtype=torch.int64)
        self.n, self.k, self.group = n, k, group


def _bound(x: torch.Tensor, layer: Layer, magnitude: float) -> torch.Tensor:
    """fp32 summation: K products of size up to |x| * magnitude * scale, summed in fp32."""
    per_input = torch.arange(layer.k) // layer.group
    return 1e-6 * layer.k * (x.abs().double() @ (magnitude * layer.scales.double()[:, per_input]).T) + 1e-6


SHAPES = [(16, 64, 32), (40, 128, 64), (33, 256, 128), (7, 96, 32), (2048, 1536, 128), (48, 160, 160)]


def test_int4_kernel_builds_where_the_cpu_kernels_do() -> None:
    if CANNOT_BUILD is not None:
        pytest.skip(f"the CPU kernels cannot be built here: {CANNOT_BUILD}")
    assert kernel is not None
    if cpu._cpu_has_avx512_bf16() and not os.environ.get("VLMSERVE_CPU_PATH"):
        assert kernel.has_avx512


@needs_kernel
@pytest.mark.parametrize(("n", "k", "group"), SHAPES)
def test_avx2_kernel_matches_the_dequantized_product(n: int, k: int, group: int) -> None:
    assert kernel is not None
    layer = Layer(n, k, group, seed=n + k)
    bias = torch.randn(n)
    for m in (1, 2, 3, 5, KERNEL_MAX_ROWS):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        want = F.linear(x.double(), layer.weight)
        bound = _bound(x, layer, 15.0 * 2)
        for b in (None, bias):
            y = torch.empty(m, n)
            kernel._lib.vlm_linear_int4(
                x.data_ptr(), layer.desc.data_ptr(), 0 if b is None else b.data_ptr(), y.data_ptr(), m, n, k
            )
            expected = want if b is None else want + bias.double()
            assert ((y.double() - expected).abs() <= bound).all(), (m, (y.double() - expected).abs().max())


@needs_avx512
@pytest.mark.parametrize(("n", "k", "group"), SHAPES)
def test_avx512_kernel_matches_the_dequantized_product(n: int, k: int, group: int) -> None:
    assert kernel is not None
    layer = Layer(n, k, group, seed=n * k)
    bias = torch.randn(n)
    for m in (1, 2, 4, 5, 7, 9, 33, KERNEL_MAX_ROWS, 75):  # tiles of 8 rows, then of 4, 2 and 1
        xb = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        want = F.linear(xb.double(), layer.weight)
        # x * (128 + q) summed, then 128 + zero times the group's sum of x taken away
        bound = _bound(xb.float(), layer, 2.0 * (128 + 15))
        for b in (None, bias):
            got = kernel.linear(xb, layer.desc, b, n, torch.float32)
            expected = want if b is None else want + bias.double()
            assert got.shape == (m, n) and got.dtype == torch.float32
            assert ((got.double() - expected).abs() <= bound).all(), (m, (got.double() - expected).abs().max())
            # bf16 out: the same fp32 results, each rounded once as torch rounds them
            assert torch.equal(kernel.linear(xb, layer.desc, b, n, torch.bfloat16), got.bfloat16())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "group"), [(40, 128, 64), (33, 256, 128)])
def test_dequantization_is_exact(dtype: torch.dtype, n: int, k: int, group: int) -> None:
    assert kernel is not None
    layer = Layer(n, k, group, seed=5)
    expected = layer.weight.float().to(dtype)  # exact in fp32 ((q - zero) * an fp16 scale), rounded once
    assert torch.equal(kernel.dequantize(layer.desc, 0, n, k, dtype), expected)
    assert torch.equal(kernel.dequantize(layer.desc, 16, 33, k, dtype), expected[16:33])


@needs_kernel
@pytest.mark.parametrize("rows", [1, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_on_both_paths(rows: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    assert kernel is not None
    layer = Layer(40, 128, 32, seed=7)
    bias = torch.randn(40).to(dtype)
    x = torch.randn(1, rows, 128, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = int4_linear(x, layer.desc, bias, 40, kernel)
    assert got.shape == (1, rows, 40) and got.dtype == dtype
    # the many-row path (but for bf16 on the AVX-512 kernel, which takes every row count): the
    # float product of the dequantized weight in x's dtype, exactly
    weight = layer.weight.float().to(dtype)
    if rows > KERNEL_MAX_ROWS and not (kernel.has_avx512 and dtype == torch.bfloat16):
        assert torch.equal(got, F.linear(x, weight, bias))
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: the output's rounding
    torch.testing.assert_close(got.double(), F.linear(x.double(), layer.weight, bias.double()), rtol=tol, atol=tol)
    monkeypatch.setattr(int4, "DEQUANT_ROWS", 16)  # the chunked dequantization, on a small matrix
    chunked = int4_linear(x, layer.desc, bias, 40, kernel)
    torch.testing.assert_close(chunked.double(), F.linear(x.double(), layer.weight, bias.double()), rtol=tol, atol=tol)


@pytest.fixture
def fresh_int4(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """load_int4_kernel un-cached, reading a fake /proc/cpuinfo (this machine's, unless rewritten)."""
    fake = tmp_path / "cpuinfo"
    fake.write_text(Path("/proc/cpuinfo").read_text())
    monkeypatch.setattr(cpu, "CPUINFO", fake)
    monkeypatch.delenv("VLMSERVE_CPU_PATH", raising=False)
    monkeypatch.delenv("VLMSERVE_CPU_KERNELS", raising=False)
    load_int4_kernel.cache_clear()
    yield fake
    load_int4_kernel.cache_clear()


@needs_avx512
def test_the_cpu_path_variable_picks_the_int4_path(fresh_int4: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def loaded(path: str | None) -> Int4Kernel:
        if path is None:
            monkeypatch.delenv("VLMSERVE_CPU_PATH", raising=False)
        else:
            monkeypatch.setenv("VLMSERVE_CPU_PATH", path)
        load_int4_kernel.cache_clear()
        k = load_int4_kernel()
        assert k is not None
        return k

    auto = loaded(None)
    assert auto.decode and auto.has_avx512 and "AVX-512" in auto.describe()
    avx2 = loaded("avx2")
    assert avx2.decode and not avx2.has_avx512 and "cpu_int4.c (AVX2)" in avx2.describe()
    layer = Layer(40, 128, 32, seed=9)
    x = torch.randn(2, 128).bfloat16()
    # the AVX2 kernel takes bf16 activations widened to fp32: the same product within fp32 sums
    torch.testing.assert_close(
        int4_linear(x, layer.desc, None, 40, avx2).double(), F.linear(x.double(), layer.weight), rtol=2e-2, atol=2e-2
    )
    torch_path = loaded("torch")
    assert not torch_path.decode and "dequantize per call" in torch_path.describe()
    got = int4_linear(x, layer.desc, None, 40, torch_path)  # decode rows, yet dequantized
    assert torch.equal(got, F.linear(x, layer.weight.float().bfloat16()))
    fresh_int4.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c\n")  # AVX-512 disabled
    assert not loaded(None).has_avx512
    fresh_int4.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx\n")  # no AVX2: the checkpoint is dequantized
    load_int4_kernel.cache_clear()
    assert load_int4_kernel() is None
