"""The element-wise CPU kernels (cpu_linear.c) against the torch expressions they replace in
models/layers.py: residual add + RMSNorm, and rotary embedding on strided q/k views of a fused
qkv output (bf16 rounding after every op; the vision towers' fp32 variant; the scalar kernel and
cpu_linear_avx512.c's); and the MLP activations of cpu_linear_avx512.c (quick_gelu, SwiGLU) where
the CPU has AVX-512 BF16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlmserve.kernels import cpu
from vlmserve.kernels.cpu import load_avx512_kernels, load_cpu_kernels
from vlmserve.models.layers import (
    RMSNorm,
    SiluAndMul,
    apply_rotary,
    apply_rotary_qk,
    apply_rotary_qk_fp32,
    quick_gelu,
    rotate_half,
)

kernels = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="the CPU kernels need AVX2 and a C compiler")
avx512 = load_avx512_kernels()
needs_avx512 = pytest.mark.skipif(avx512 is None, reason="this CPU has no AVX-512 BF16 (or the kernel did not build)")


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps between same-signed values (the bit patterns' difference)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, 40])  # 40: the rows are split among threads
@pytest.mark.parametrize("hidden", [1536, 100])
def test_add_rms_norm_is_the_residual_add_then_torchs_norm(rows: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=g) * 4).bfloat16()
    delta = torch.randn(rows, hidden, generator=g).bfloat16()
    norm = RMSNorm(hidden, eps=1e-5).bfloat16()
    norm.weight.data = (torch.rand(hidden, generator=g) + 0.5).bfloat16()
    with torch.inference_mode():
        total, out = norm.add(x, delta)
        plain = norm(x)
    assert torch.equal(total, x + delta)  # one bf16 rounding of the sum, as torch's add
    want = _torch_rms_norm(x + delta, norm.weight, 1e-5)
    # Only the mean's summation order differs: a rare last-bit flip, never more.
    assert _bf16_ulps(out, want).max() <= 1 and (out != want).float().mean() < 1e-3
    want_plain = _torch_rms_norm(x, norm.weight, 1e-5)
    assert _bf16_ulps(plain, want_plain).max() <= 1 and (plain != want_plain).float().mean() < 1e-3


@needs_kernels
def test_rms_norm_keeps_torch_for_float32_and_strided_inputs() -> None:
    norm = RMSNorm(64).float()
    x = torch.randn(3, 64)
    assert torch.equal(norm(x), _torch_rms_norm(x, norm.weight, norm.eps))
    xb = torch.randn(64, 3).bfloat16().t()  # not contiguous: torch's expression
    assert torch.equal(norm.bfloat16()(xb), _torch_rms_norm(xb, norm.weight, norm.eps))


def _qkv(rows: int, nq: int, nk: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, (nq + 2 * nk) * d, generator=g) * 3).bfloat16()


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 3, 20])  # 20: the tokens are split among threads
def test_rms_norm_heads_normalises_each_head_of_a_qkv_view_in_place(tokens: int) -> None:
    nq, nk, d = 4, 2, 32
    qkv = _qkv(tokens, nq, nk, d, seed=tokens)
    before = qkv.clone()
    norm = RMSNorm(d, eps=1e-6).bfloat16()
    norm.weight.data = (torch.rand(d, generator=torch.Generator().manual_seed(5)) + 0.5).bfloat16()
    k = qkv[:, nq * d : (nq + nk) * d].view(tokens, nk, d)  # rows (nq + 2 nk) d apart
    with torch.inference_mode():
        out = norm.heads_(k)
        rows = norm(before[:, nq * d : (nq + nk) * d].reshape(tokens * nk, d).contiguous())
    assert out.data_ptr() == k.data_ptr()  # in place
    assert torch.equal(out.reshape(tokens * nk, d), rows)  # the row kernel's bits, head by head
    want = _torch_rms_norm(before[:, nq * d : (nq + nk) * d].view(tokens, nk, d), norm.weight, 1e-6)
    assert _bf16_ulps(out, want).max() <= 1  # torch's expression but for the mean's summation order
    assert torch.equal(qkv[:, : nq * d], before[:, : nq * d])  # q and v untouched
    assert torch.equal(qkv[:, (nq + nk) * d :], before[:, (nq + nk) * d :])
    xf = before[:, : nq * d].float().view(tokens, nq, d)  # float32: torch's expression, a new tensor
    assert torch.equal(norm.float().heads_(xf), _torch_rms_norm(xf, norm.weight, 1e-6))


@pytest.fixture(params=["auto", "avx2"])
def rotary_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The rotary kernel under test: the AVX-512 one where it builds ("auto"), and the scalar one of
    cpu_linear.c (VLMSERVE_CPU_PATH=avx2 turns the AVX-512 kernels off)."""
    monkeypatch.setenv("VLMSERVE_CPU_PATH", request.param)
    return request.param


@needs_kernels
@pytest.mark.parametrize(("rows", "d"), [(1, 128), (3, 128), (33, 128), (33, 72)])  # 72: a masked tail of 4 lanes
def test_rotary_in_place_on_qkv_views_equals_torchs_bf16_ops(rows: int, d: int, rotary_path: str) -> None:
    nq, nk = 12, 2
    qkv = _qkv(rows, nq, nk, d, rows)
    q, k, v = qkv.split([nq * d, nk * d, nk * d], dim=-1)
    q, k = q.view(rows, nq, d), k.view(rows, nk, d)
    angles = torch.rand(rows, d, generator=torch.Generator().manual_seed(1)) * 100
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    want_q, want_k, want_v = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.clone()
    got_q, got_k = apply_rotary_qk(q, k, cos, sin)
    assert got_q.data_ptr() == qkv.data_ptr()  # rotated in place
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)  # the same bits: no sums reordered
    assert torch.equal(v, want_v)  # v untouched


@needs_kernels
@pytest.mark.parametrize("d", [80, 104])  # Qwen2-VL's and Qwen-VL's vision heads: tails of 8 and 4 lanes
def test_vision_rotary_in_fp32_equals_the_reference_expression(d: int, rotary_path: str) -> None:
    rows, heads = 70, 16
    qkv = _qkv(rows, heads, heads, d, 7)
    q, k, v = qkv.view(rows, 3, heads, d).unbind(1)  # the vision towers' layout: rows 3 * heads * d apart
    angles = torch.rand(rows, d, generator=torch.Generator().manual_seed(2)) * 40
    cos, sin = angles.cos(), angles.sin()

    def reference(x: torch.Tensor) -> torch.Tensor:
        return (x.float() * cos[:, None] + rotate_half(x.float()) * sin[:, None]).to(x.dtype)

    want_q, want_k, want_v = reference(q), reference(k), v.clone()
    got_q, got_k = apply_rotary_qk_fp32(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(v, want_v)
    # fp32 activations: torch's expression, unchanged
    qf, kf = q.float(), k.float()
    got = apply_rotary_qk_fp32(qf, kf, cos, sin)
    assert torch.equal(got[0], reference(qf)) and torch.equal(got[1], reference(kf))


def _torch_quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _torch_swiglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


SPECIAL = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), -100.0, 100.0, -90.0, 1e-40, -1e-40, 88.0, -88.0, 1e38]


@needs_avx512
@pytest.mark.parametrize(("rows", "n"), [(1, 8960), (3, 100), (341, 1280)])  # a row, a tail past 16, threads
def test_mlp_activations_round_as_torchs_bf16_ops(rows: int, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    assert avx512 is not None
    monkeypatch.delenv("VLMSERVE_CPU_PATH", raising=False)
    monkeypatch.setattr(cpu, "load_avx512_kernels", lambda: avx512)  # the instance watched here
    calls: list[str] = []
    for name in ("quick_gelu", "silu_and_mul"):
        real = getattr(avx512, name)
        monkeypatch.setattr(avx512, name, lambda x, real=real, name=name: calls.append(name) or real(x))
    g = torch.Generator().manual_seed(rows + n)
    for scale in (1.0, 4.0, 30.0):
        x = (torch.randn(rows, 2 * n, generator=g) * scale).bfloat16()
        for got, want in ((quick_gelu(x), _torch_quick_gelu(x)), (SiluAndMul()(x), _torch_swiglu(x))):
            # exp in another order of operations: a last-bit flip where a value lies within an
            # fp32 ulp or so of a bf16 rounding boundary, never more
            assert got.shape == want.shape and got.dtype == torch.bfloat16
            assert _bf16_ulps(got, want).max() <= 1 and (got != want).float().mean() < 1e-3
    assert calls == ["quick_gelu", "silu_and_mul"] * 3
    special = torch.tensor(SPECIAL).bfloat16()[None]  # overflow, underflow, denormals, NaN: as torch
    assert torch.equal(quick_gelu(special).view(torch.int16), _torch_quick_gelu(special).view(torch.int16))
    pairs = torch.cat([special, special.flip(-1)], dim=-1)
    assert torch.equal(SiluAndMul()(pairs).view(torch.int16), _torch_swiglu(pairs).view(torch.int16))


@needs_avx512
def test_mlp_activations_keep_torch_for_float32_and_another_forced_path(monkeypatch: pytest.MonkeyPatch) -> None:
    assert avx512 is not None

    def refuse(x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the AVX-512 activation ran")

    monkeypatch.setattr(cpu, "load_avx512_kernels", lambda: avx512)
    monkeypatch.setattr(avx512, "quick_gelu", refuse)
    monkeypatch.setattr(avx512, "silu_and_mul", refuse)
    x = torch.randn(4, 64)
    assert torch.equal(quick_gelu(x), _torch_quick_gelu(x)) and torch.equal(SiluAndMul()(x), _torch_swiglu(x))
    for path in ("avx2", "torch"):
        monkeypatch.setenv("VLMSERVE_CPU_PATH", path)
        xb = x.bfloat16()
        assert torch.equal(quick_gelu(xb), _torch_quick_gelu(xb)) and torch.equal(SiluAndMul()(xb), _torch_swiglu(xb))
