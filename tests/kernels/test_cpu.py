"""The CPU kernels (cpu_linear.c) against references written here: bf16 linear layers and the
paged decode attention, in bf16 (the default path for bf16 checkpoints) and fp32.

The tests of the compiled kernels skip only where this machine cannot build them (and say
which reason); a machine that can and fails to is a failure. Selection, the reasons to fall
back, and the fallback attention path run everywhere."""

from __future__ import annotations

import fnmatch
import importlib.util
import logging
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib
import torch
import torch.nn.functional as F

from vlmserve.attention import select_backend
from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.attention.torch_backend import TorchAttentionBackend
from vlmserve.kernels import cpu, select_linear_op
from vlmserve.kernels.cpu import GEMM_ROWS, decode_kernel_applies, load_cpu_kernels
from vlmserve.kernels.dispatch import CpuLinearDispatch


def _why_no_kernels() -> str | None:
    """Why this machine cannot have the compiled kernels, or None where it can."""
    if os.environ.get("VLMSERVE_CPU_KERNELS", "1") == "0":
        return "VLMSERVE_CPU_KERNELS=0"
    if not cpu._cpu_has_avx2():
        return "this CPU lacks AVX2, FMA or F16C"
    if (shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")) is None:
        return "no C compiler (cc or gcc)"
    return None


CANNOT_BUILD = _why_no_kernels()
kernels = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(
    kernels is None, reason=f"no compiled CPU kernels: {CANNOT_BUILD or 'the build failed (see the build test)'}"
)
avx512 = cpu.load_avx512_kernels()
needs_avx512 = pytest.mark.skipif(avx512 is None, reason="this CPU has no AVX-512 BF16 (or the kernel did not build)")


def test_kernels_build_where_the_cpu_and_a_compiler_allow() -> None:
    if CANNOT_BUILD is not None:
        pytest.skip(f"the CPU kernels cannot be built here: {CANNOT_BUILD}")
    assert kernels is not None, "AVX2, FMA, F16C and a C compiler are present, yet the kernels did not build"


# -- linear ----------------------------------------------------------------------------------------


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
    assert kernels is not None
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
    assert kernels is not None
    x = torch.randn(2, 3, 16, 40).bfloat16()[..., ::2]  # [2, 3, 16, 20], strided
    w = torch.randn(24, 20).bfloat16()
    out = kernels.linear_bf16(x, w, None)
    assert out.shape == (2, 3, 16, 24)
    assert torch.allclose(out.float(), F.linear(x.float(), w.float()), rtol=2**-7, atol=1e-2)


@needs_kernels
def test_widen_is_exact() -> None:
    assert kernels is not None
    t = torch.randn(1000, 37).bfloat16()
    assert torch.equal(kernels.widen(t), t.float())


# -- the sampler's top-k candidates -------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("vocab", "k"), [(151936, 1), (151936, 36), (1000, 256), (37, 37), (23, 5)])
def test_topk_gives_torchs_values_and_the_earliest_of_equal_ones(dtype: torch.dtype, vocab: int, k: int) -> None:
    assert kernels is not None
    g = torch.Generator().manual_seed(vocab + k)
    x = (torch.randn(6, vocab, generator=g) * 3).to(dtype)
    x[1] = 1.0  # every value tied: the first k indices
    x[2, vocab // 3] = float("nan")  # above everything, as torch orders it
    x[3, vocab - 1] = float("inf")  # in the tail past the last full vector
    x[4, : vocab // 2] = -0.0  # -0 and +0 are equal: the earlier index first
    x[4, vocab // 2 :] = 0.0
    rows = [5, 1, 2, 3, 4, 0, 2]  # any rows, in any order, twice
    values, ids = kernels.topk(x, rows, k)
    expected = x[rows].float().topk(k, dim=-1).values
    assert torch.equal(values.nan_to_num(99.0), expected.nan_to_num(99.0))
    assert torch.equal(x[rows].float().gather(1, ids).nan_to_num(99.0), values.nan_to_num(99.0))
    assert ids[1].tolist() == list(range(k)) and ids[4].tolist() == list(range(k))
    for r in range(len(rows)):  # equal values in ascending index order
        for a in range(k - 1):
            assert values[r, a] != values[r, a + 1] or ids[r, a] < ids[r, a + 1]
    # rows of a wider tensor (a row stride past the vocabulary)
    wide = torch.zeros(6, vocab + 9, dtype=dtype)
    wide[:, :vocab] = x
    assert torch.equal(kernels.topk(wide[:, :vocab], rows, k)[1], ids)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_topk_takes_only_what_a_rows_bitmask_allows(dtype: torch.dtype) -> None:
    """Structured outputs' masks (xgrammar's layout: bit t % 32 of word t // 32) as if the others
    were -inf; a row allowing fewer than k tokens ends in -inf."""
    assert kernels is not None
    vocab, k = 1003, 20  # a tail past the last 16 and the last 8, in a word of its own
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, vocab, generator=g) * 3).to(dtype)
    words = -(-vocab // 32)
    bits = torch.rand(3, words * 32, generator=g) < 0.3  # row 0 of the masks: ~30 % allowed
    bits[1] = False
    bits[1, [5, 700, 1002]] = True  # row 1: three tokens, one in the tail
    bits[2] = True  # row 2: everything
    packed = (bits.view(3, words, 32).long() << torch.arange(32)).sum(-1)
    bitmask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    rows, mask_rows = [0, 1, 2, 3, 0], [0, 1, 2, -1, -1]
    values, ids = kernels.topk(x, rows, k, bitmask, mask_rows)
    for i, (row, m) in enumerate(zip(rows, mask_rows, strict=True)):
        reference = x[row].float().masked_fill(~bits[m, :vocab], float("-inf")) if m >= 0 else x[row].float()
        assert torch.equal(values[i], reference.topk(k).values), i
    assert sorted(ids[1, :3].tolist()) == [5, 700, 1002] and values[1, 3:].eq(float("-inf")).all()
    assert torch.equal(ids[3], kernels.topk(x, [3], k)[1][0])


@needs_kernels
def test_apply_bitmask_is_xgrammars_in_place_mask() -> None:
    """-inf where a row's mask bit is 0, in the rows asked for only (a vocabulary ending inside a
    word, words all set skipped, all clear, and mixed)."""
    import xgrammar

    assert kernels is not None
    vocab = 1003
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 32), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # everything allowed
    bitmask[2, :10] = 0  # nothing in the first 320 tokens
    expected = x.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab, indices=[0, 1, 2, 4])
    kernels.apply_bitmask(x, [0, 1, 2, 4], bitmask, [0, 1, 2, 4])
    assert torch.equal(x, expected) and torch.isinf(x[2, :320]).all() and torch.isfinite(x[3]).all()


# -- paged decode attention --------------------------------------------------------------------------

BLOCK_SIZE = 16
# What fp32 arithmetic may add, relative to the largest value a head attends over. Its rounding
# errors (unit roundoff 2^-24 = 6e-8 a step) build up along dot products of head_dim terms and
# sums of seq_len terms like a random walk: ~1e-6 at these sizes, the allowance 10 times that.
# (The worst case, every error aligned, is ~(head_dim + seq_len) 2^-24 |score| ~ 1e-3: loose
# enough to let arithmetic done in bf16 through.)
FP32_ERROR = 1e-5


def paged_cache(
    seq_lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype, garbage: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [2, blocks, BLOCK_SIZE, kv_heads, head_dim] cache holding each sequence in shuffled
    blocks, with `garbage` in every slot no sequence holds; and the block tables (padded with
    -1: a kernel reading past a sequence's blocks would fault or read garbage)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(need) + 3  # some blocks nobody holds
    cache = torch.full((2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), garbage)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(seq_lens), max(need)), -1, dtype=torch.int64)
    for s, n in enumerate(seq_lens):
        blocks, order = order[: need[s]], order[need[s] :]
        tables[s, : need[s]] = torch.tensor(blocks)
        t = torch.arange(n)
        cache[:, tables[s, t // BLOCK_SIZE], t % BLOCK_SIZE] = torch.randn(2, n, num_kv_heads, head_dim, generator=g)
    return cache.to(dtype), tables


def reference_decode(
    q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, seq_lens: list[int], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 attention of each sequence's one query over its first seq_len cached tokens, query
    head h reading KV head h // (num_heads / num_kv_heads); and, per (sequence, head), the
    error fp32 arithmetic may add: FP32_ERROR times the largest |value| attended over."""
    num_seqs, num_heads, head_dim = q.shape
    group = num_heads // cache.shape[3]
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float64)
    allowance = torch.empty(num_seqs, num_heads, 1, dtype=torch.float64)
    for s, n in enumerate(seq_lens):
        t = torch.arange(n)
        kv = cache[:, tables[s, t // BLOCK_SIZE], t % BLOCK_SIZE].double()  # [2, n, kv_heads, dim]
        for h in range(num_heads):
            k, v = kv[0, :, h // group], kv[1, :, h // group]
            out[s, h] = torch.softmax(k @ (q[s, h].double() * scale), dim=0) @ v
            allowance[s, h] = FP32_ERROR * float(v.abs().max())
    return out, allowance


DECODE_SHAPES = [  # (num_heads, num_kv_heads, head_dim)
    (4, 2, 16),  # the tiny test checkpoint
    (12, 2, 128),  # Qwen2-VL-2B
    (28, 4, 128),  # Qwen2-VL-7B: 7 query heads per KV head
    (16, 1, 20),  # the most query heads per KV head; a head_dim with a tail past the 8-wide loop
    (2, 2, 256),  # the largest head_dim
]
SEQ_LENS = [1, 16, 17, 100]  # one token, a full block, one past it, several blocks and a part


@pytest.mark.parametrize("path", ["avx2", "avx512"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), DECODE_SHAPES)
def test_bf16_decode_attention_matches_fp64_reference_rounded_once(
    path: str, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """Both kernels (the AVX-512 one where it applies: head_dim a multiple of 32), on the test's
    sequence lengths and on a longer context (many chunks of 32 tokens, the softmax rescaled
    between them)."""
    library = kernels if path == "avx2" else avx512
    if library is None:
        pytest.skip(f"no {path} kernel here")
    g = torch.Generator().manual_seed(num_heads)
    for seq_lens, seed in ((SEQ_LENS, head_dim), ([1000, 33, 64], 1)):
        # NaN in every slot outside the sequences: reading one (past seq_len, or a wrong block)
        # turns the output NaN.
        cache, tables = paged_cache(seq_lens, num_kv_heads, head_dim, torch.bfloat16, math.nan, seed=seed)
        q = (2 * torch.randn(len(seq_lens), num_heads, head_dim, generator=g)).bfloat16()  # peaked softmax
        scale = head_dim**-0.5
        out = library.decode_attention(q, cache, tables, torch.tensor(seq_lens), scale)
        if path == "avx512" and head_dim % 32:
            assert out is None  # declined: the AVX2 kernel takes it
            return
        assert out is not None and out.dtype == torch.bfloat16 and out.shape == q.shape
        reference, fp32_error = reference_decode(q, cache, tables, seq_lens, scale)
        # The inputs are bf16, exact in fp32; the kernel's fp32 result y is within fp32_error of the
        # reference and is rounded once to bf16, by at most half a bf16 step (2^-8 |y|):
        # |out - ref| <= 2^-8 |y| + fp32_error <= 2^-8 |ref| + 2 fp32_error.
        error = (out.double() - reference).abs()
        assert (error <= 2.0**-8 * reference.abs() + 2 * fp32_error).all()
        # So it is the reference rounded to bf16, except where the reference lies within fp32_error
        # of a rounding boundary: a fraction ~ fp32_error / bf16 step, well under 1%. (Truncating
        # instead of rounding, or any intermediate in bf16, misses far more.)
        assert (out == reference.bfloat16()).double().mean() > 0.99
        if seq_lens[0] == 1:  # one token: its value, exactly
            assert torch.equal(out[0], cache[1, tables[0, 0], 0].repeat_interleave(num_heads // num_kv_heads, dim=0))
    if path == "avx512":  # bf16 only
        assert library.decode_attention(q.float(), cache.float(), tables, torch.tensor(seq_lens), scale) is None


def test_the_backend_uses_avx512_kernels_unless_another_path_is_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    class Fake:
        def __init__(self, name: str) -> None:
            self.name = name

        def decode_attention(self, *args: object) -> None:
            calls.append(self.name)  # and declines (None)

        def prefill_attention(self, *args: object) -> None:
            calls.append(f"{self.name} prefill")

    monkeypatch.setattr(cpu, "load_cpu_kernels", lambda: Fake("avx2"))
    monkeypatch.setattr(cpu, "load_avx512_kernels", lambda: Fake("avx512"))
    args = (torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), 1.0)
    for path, expected in (
        (None, ["avx512", "avx2"]),
        ("avx512", ["avx512", "avx2"]),
        ("avx2", ["avx2"]),
        ("torch", ["avx2"]),
    ):
        if path is None:
            monkeypatch.delenv("VLMSERVE_CPU_PATH", raising=False)
        else:
            monkeypatch.setenv("VLMSERVE_CPU_PATH", path)
        backend = select_backend(torch.device("cpu"))
        assert isinstance(backend, TorchAttentionBackend) and backend.decode_kernel is not None
        calls.clear()
        assert backend.decode_kernel(*args) is None  # type: ignore[arg-type]
        # the AVX-512 kernel is asked first; where it declines the AVX2 one runs
        assert calls == expected, path
        # prefill: the AVX-512 flash kernel, or (another path forced) SDPA
        calls.clear()
        if "avx512" in expected:
            assert backend.prefill_kernel is not None
            assert backend.prefill_kernel(*args[:4], None) is None  # type: ignore[arg-type]
            assert calls == ["avx512 prefill"]
        else:
            assert backend.prefill_kernel is None


@needs_kernels
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), DECODE_SHAPES[:3])
def test_fp32_decode_attention_matches_fp64_reference(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    assert kernels is not None
    cache, tables = paged_cache(SEQ_LENS, num_kv_heads, head_dim, torch.float32, math.nan, seed=head_dim)
    q = 2 * torch.randn(len(SEQ_LENS), num_heads, head_dim, generator=torch.Generator().manual_seed(num_heads))
    out = kernels.decode_attention(q, cache, tables, torch.tensor(SEQ_LENS), head_dim**-0.5)
    assert out is not None and out.dtype == torch.float32
    reference, fp32_error = reference_decode(q, cache, tables, SEQ_LENS, head_dim**-0.5)
    assert ((out.double() - reference).abs() <= fp32_error).all()


def test_decode_kernel_takes_only_what_its_buffers_hold() -> None:
    def applies(
        heads: int,
        kv_heads: int,
        dim: int,
        dtype: torch.dtype = torch.bfloat16,
        q_dtype: torch.dtype | None = None,
        kv_dim: int | None = None,
        strided: bool = False,
    ) -> bool:
        q = torch.zeros(1, heads, dim, dtype=q_dtype or dtype)
        cache = torch.zeros(2, 2, BLOCK_SIZE, kv_heads, kv_dim or dim, dtype=dtype)
        return decode_kernel_applies(q, cache.transpose(1, 2) if strided else cache)

    assert applies(4, 2, 16) and applies(4, 2, 16, torch.float32)
    assert applies(2, 2, 256) and applies(16, 1, 64)  # the limits themselves
    assert not applies(2, 2, 257)  # past the per-thread head_dim buffers
    assert not applies(17, 1, 64)  # more query heads per KV head than the buffers hold
    assert not applies(6, 4, 16)  # heads not a multiple of KV heads
    assert not applies(4, 2, 16, torch.float16)
    assert not applies(4, 2, 16, torch.bfloat16, q_dtype=torch.float32)
    assert not applies(4, 2, 16, kv_dim=32)
    assert not applies(4, 2, 16, strided=True)
    if kernels is not None:  # declined inputs never reach the C code
        q = torch.zeros(1, 2, 257, dtype=torch.bfloat16)
        cache = torch.zeros(2, 1, BLOCK_SIZE, 2, 257, dtype=torch.bfloat16)
        assert kernels.decode_attention(q, cache, torch.zeros(1, 1, dtype=torch.int64), torch.tensor([1]), 1.0) is None


def check_decode_step(backend: TorchAttentionBackend, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """One step of one new token per sequence through the backend's paged attention (fp32):
    the step's K/V land in their slots and the output is the fp64 reference on that cache."""
    # Finite garbage outside the sequences (the fallback gathers padded blocks; its mask
    # removes them, but NaN times a zero weight would still be NaN).
    cache, tables = paged_cache(SEQ_LENS, num_kv_heads, head_dim, torch.float32, 1e3, seed=7)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(len(SEQ_LENS), num_heads, head_dim, generator=g)
    k, v = torch.randn(2, len(SEQ_LENS), num_kv_heads, head_dim, generator=g)
    last = torch.tensor(SEQ_LENS) - 1
    slots = tables[torch.arange(len(SEQ_LENS)), last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables.clamp(min=0),
        seq_lens=torch.tensor(SEQ_LENS),
        query_start_loc=list(range(len(SEQ_LENS) + 1)),
        seq_lens_host=SEQ_LENS,
        block_size=BLOCK_SIZE,
    )
    out = backend.paged_attention(q, k, v, cache, meta, head_dim**-0.5)
    assert torch.equal(cache[0].view(-1, num_kv_heads, head_dim)[slots], k)  # the step's K/V written
    reference, fp32_error = reference_decode(q, cache, tables, SEQ_LENS, head_dim**-0.5)
    assert ((out.double() - reference).abs() <= fp32_error).all()


@pytest.mark.parametrize("workspace_tokens", [32768, 128])  # one padded group; groups of 100, 17 + 16
def test_fallback_decode_without_a_kernel_matches_the_reference(workspace_tokens: int) -> None:
    check_decode_step(TorchAttentionBackend(workspace_tokens, decode_kernel=None), 12, 2, 32)


def test_fallback_decode_when_the_kernel_declines_matches_the_reference() -> None:
    calls = []

    def declining(*args: object) -> None:
        calls.append(args)
        return None

    check_decode_step(TorchAttentionBackend(32768, decode_kernel=declining), 12, 2, 32)
    assert len(calls) == 1  # offered the decode rows (one step), declined, fell back


@needs_kernels
def test_backend_decodes_through_the_compiled_kernel() -> None:
    assert kernels is not None
    calls = []

    def kernel(*args: torch.Tensor | float) -> torch.Tensor | None:
        assert kernels is not None
        calls.append(args)
        return kernels.decode_attention(*args)  # type: ignore[arg-type]

    check_decode_step(TorchAttentionBackend(32768, decode_kernel=kernel), 12, 2, 32)
    assert len(calls) == 1


# -- selection and the reasons to fall back ------------------------------------------------------------


class FakeKernels:
    """Stands in for a CpuKernels where no compiler is needed."""

    def linear_bf16(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise AssertionError("not called")

    def decode_attention(self, *args: object) -> None:
        return None


def test_selection_is_made_per_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeKernels()
    monkeypatch.setattr(cpu, "load_cpu_kernels", lambda: fake)
    monkeypatch.setattr(cpu, "load_avx512_kernels", lambda: None)
    monkeypatch.setenv("VLMSERVE_CPU_PATH", "avx2")
    op = select_linear_op(torch.device("cpu"), torch.bfloat16, [(8, 4)])
    assert isinstance(op, CpuLinearDispatch) and op.ops == {"avx2": fake.linear_bf16}
    assert select_linear_op(torch.device("cpu"), torch.float32) is F.linear
    assert select_linear_op(torch.device("cuda"), torch.bfloat16) is F.linear
    decode = select_backend(torch.device("cpu"))
    assert isinstance(decode, TorchAttentionBackend) and decode.decode_kernel == fake.decode_attention
    gpu = select_backend(torch.device("cuda"), "torch")
    assert isinstance(gpu, TorchAttentionBackend) and gpu.decode_kernel is None
    # auto: triton on CUDA where the package is installed
    assert select_backend(torch.device("cuda")).name == ("triton" if importlib.util.find_spec("triton") else "torch")
    monkeypatch.setattr(cpu, "load_cpu_kernels", lambda: None)  # no kernels: torch everywhere
    assert select_linear_op(torch.device("cpu"), torch.bfloat16) is F.linear
    none = select_backend(torch.device("cpu"))
    assert isinstance(none, TorchAttentionBackend) and none.decode_kernel is None


def test_cpu_feature_check_needs_avx2_fma_and_f16c(tmp_path: Path) -> None:
    def has(flags: str) -> bool:
        (tmp_path / "cpuinfo").write_text(f"processor\t: 0\nflags\t\t: fpu sse2 {flags}\n")
        return cpu._cpu_has_avx2(tmp_path / "cpuinfo")

    assert has("avx avx2 fma f16c bmi2")
    assert not has("avx avx2 fma")  # no f16c
    assert not has("avx avx2 f16c")  # no fma
    assert not has("avx avx512f fma f16c")  # avx512f is not avx2
    assert not cpu._cpu_has_avx2(tmp_path / "missing")


@pytest.fixture
def fresh_loader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """load_cpu_kernels un-cached, building into an empty cache, as if on a new machine."""
    monkeypatch.setenv("VLMSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VLMSERVE_CPU_KERNELS", raising=False)
    monkeypatch.setattr(cpu, "_cpu_has_avx2", lambda: True)
    load_cpu_kernels.cache_clear()
    yield
    load_cpu_kernels.cache_clear()


def fake_compiler(tmp_path: Path, body: str) -> str:
    script = tmp_path / "fake-cc"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return str(script)


@pytest.mark.usefixtures("fresh_loader")
def test_no_kernels_when_disabled_or_the_cpu_lacks_avx2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLMSERVE_CPU_KERNELS", "0")
    assert load_cpu_kernels() is None
    monkeypatch.delenv("VLMSERVE_CPU_KERNELS")
    load_cpu_kernels.cache_clear()
    monkeypatch.setattr(cpu, "_cpu_has_avx2", lambda: False)
    assert load_cpu_kernels() is None


@pytest.mark.usefixtures("fresh_loader")
def test_no_kernels_without_a_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu.shutil, "which", lambda name: None)
    assert load_cpu_kernels() is None


@pytest.mark.usefixtures("fresh_loader")
def test_no_kernels_when_the_build_fails_and_a_warning_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", fake_compiler(tmp_path, "echo 'cpu_linear.c: error: no' >&2; exit 1"))
    with caplog.at_level(logging.WARNING, logger="vlmserve.kernels.cpu"):
        assert load_cpu_kernels() is None
    assert "building the CPU kernels failed" in caplog.text and "cpu_linear.c: error: no" in caplog.text


@pytest.mark.usefixtures("fresh_loader")
def test_no_kernels_when_the_built_library_does_not_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # "Builds" a file that is no shared library: loading it raises OSError.
    body = 'while [ "$1" != "-o" ]; do shift; done; echo "not a library" > "$2"'
    monkeypatch.setenv("CC", fake_compiler(tmp_path, body))
    with caplog.at_level(logging.WARNING, logger="vlmserve.kernels.cpu"):
        assert load_cpu_kernels() is None
    assert "loading the CPU kernels failed" in caplog.text


def test_the_kernel_sources_ship_in_the_package() -> None:
    """The C sources (and their header) are compiled on first use, so a wheel must carry them:
    without them a non-editable install silently falls back to torch's paths."""
    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = patterns.get("vlmserve.kernels", [])
    sources = [p.name for p in (root / "vlmserve" / "kernels").iterdir() if p.suffix in (".c", ".h")]
    assert {"cpu_linear.c", "cpu_linear_avx512.c", "cpu_int8.c", "cpu_int8_avx512.c", "bf16.h"} <= set(sources)
    assert all(any(fnmatch.fnmatch(name, p) for p in shipped) for name in sources), (sources, shipped)
