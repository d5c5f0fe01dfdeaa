"""Loads the CPU bf16 kernels: cpu_linear.c (AVX2: linear layers and paged decode attention) and
cpu_linear_avx512.c (AVX-512 BF16: linear layers), each compiled with the system C compiler on
first use with its own -m flags, cached by source and flags hash, called through ctypes (which
releases the GIL). Which one a layer uses is decided in kernels/dispatch.py.

Nothing here runs at import time. `load_cpu_kernels()` (`load_avx512_kernels()`) returns None,
and callers keep another path, when the CPU lacks AVX2/FMA/F16C (AVX-512 F/BW/BF16), no
compiler is found, the build fails, or VLMSERVE_CPU_KERNELS=0.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_linear.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
AVX512_SOURCE = Path(__file__).with_name("cpu_linear_avx512.c")
AVX512_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
# At or above this many rows a linear layer is compute-bound: widen the weights once and use
# torch's fp32 GEMM (MKL), which blocks for the caches far better than a simple kernel.
GEMM_ROWS = 96


# Read for the CPU's features; tests point it at a fake file.
CPUINFO = Path("/proc/cpuinfo")


def _cpu_flags(cpuinfo: Path | None) -> set[str]:
    try:
        text = (cpuinfo or CPUINFO).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def _cpu_has_avx2(cpuinfo: Path | None = None) -> bool:
    return {"avx2", "fma", "f16c"} <= _cpu_flags(cpuinfo)


def _cpu_has_avx512_bf16(cpuinfo: Path | None = None) -> bool:
    """What cpu_linear_avx512.c's instructions need: AVX-512 F (zmm), BW (masked 16-bit loads), BF16."""
    return {"avx512f", "avx512bw", "avx512_bf16"} <= _cpu_flags(cpuinfo)


def _cache_dir() -> Path:
    return Path(os.environ.get("VLMSERVE_CACHE", Path.home() / ".cache" / "vlmserve")) / "kernels"


def _build(source: Path, flags: list[str] = FLAGS) -> Path | None:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    # the headers beside the sources (bf16.h) are part of what is built
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join(flags).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    from vlmserve.progress import waiting

    desc = f"compiling {source.name} for this CPU (first use; kept in {target.parent})"
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp, waiting(desc, logger):
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *flags, str(source), "-o", str(built)], capture_output=True, text=True)
        if result.returncode != 0:
            logger.warning(
                "building the CPU kernels failed (%s); using another path:\n%s", source.name, result.stderr[-2000:]
            )
            return None
        os.replace(built, target)  # atomic: concurrent builders agree
    return target


def decode_kernel_applies(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether vlm_decode_attention takes these inputs: bf16 or fp32 throughout, a contiguous
    cache, and heads within its fixed per-thread buffers (head_dim <= 256, <= 16 query heads
    per KV head). q [num_seqs, num_heads, head_dim]; kv_cache [2, blocks, block_size,
    num_kv_heads, head_dim]."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, kv_dim = kv_cache.shape[3:]
    return (
        q.dtype in (torch.bfloat16, torch.float32)
        and kv_cache.dtype == q.dtype
        and kv_dim == head_dim
        and head_dim <= 256
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= 16
        and kv_cache.is_contiguous()
    )


def prefill_kernel_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether vlm_prefill_attention_avx512 takes these inputs: q [q_len, heads, dim], k and v
    [kv_len, kv_heads, dim], all bf16, each head's dims contiguous and the heads of a token side by
    side (any stride between tokens: views of a fused qkv output), dim even and at most 256."""
    dim = q.shape[-1]
    return (
        q.dim() == k.dim() == v.dim() == 3
        and q.shape[0] > 0
        and k.shape[0] > 0
        and q.dtype == k.dtype == v.dtype == torch.bfloat16
        and k.shape == v.shape
        and k.shape[-1] == dim
        and dim % 2 == 0
        and dim <= 256
        and q.shape[1] % k.shape[1] == 0
        and all(t.stride(2) == 1 and t.stride(1) == dim for t in (q, k, v))
    )


def _rotary_qk_(fn: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Either rotary kernel (cpu_linear.c's, cpu_linear_avx512.c's: the same arguments) in place."""
    n, nq, d = q.shape
    fn(
        q.data_ptr(), k.data_ptr(), q.stride(0), k.stride(0), cos.data_ptr(), sin.data_ptr(), n, nq, k.shape[1], d,
        int(cos.dtype == torch.bfloat16),
    )  # fmt: skip


def _decode_attention(
    fn: Any,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *extra: int,
) -> torch.Tensor:
    """Call one of the C decode attention kernels (same leading arguments; `extra` after them)."""
    num_seqs, num_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    q = q.contiguous()
    block_tables = block_tables.to(torch.int64).contiguous()
    seq_lens = seq_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    fn(
        q.data_ptr(),
        kv_cache.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        num_blocks,
        block_size,
        block_tables.shape[1],
        scale,
        *extra,
    )
    return out


class CpuKernels:
    def __init__(self, library: Path) -> None:
        # NOTE: loaded after torch, so its OpenMP dependency binds to torch's libgomp.so.1:
        # one thread pool, sized by torch.set_num_threads.
        lib = ctypes.CDLL(str(library))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.vlm_linear_bf16.argtypes = [p, p, p, p, i64, i64, i64]
        lib.vlm_linear_bf16.restype = None
        lib.vlm_bf16_to_f32.argtypes = [p, p, i64]
        lib.vlm_bf16_to_f32.restype = None
        lib.vlm_decode_attention.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, i64]
        lib.vlm_decode_attention.restype = None
        lib.vlm_add_rms_norm_bf16.argtypes = [p, p, p, p, p, i64, i64, ctypes.c_float]
        lib.vlm_rotary_qk_bf16.argtypes = [p, p, i64, i64, p, p, i64, i64, i64, i64, i64]
        lib.vlm_argmax_bf16.argtypes = [p, p, i64, i64]
        lib.vlm_topk.argtypes = [p, i64, i64, p, i64, i64, i64, p, p, p, i64, p]
        lib.vlm_topk.restype = None
        lib.vlm_apply_bitmask.argtypes = [p, i64, p, i64, i64, p, i64, p]
        lib.vlm_apply_bitmask.restype = None
        lib.vlm_rms_norm_heads_bf16.argtypes = [p, i64, p, i64, i64, i64, ctypes.c_float]
        for name in ("add_rms_norm_bf16", "rms_norm_heads_bf16", "rotary_qk_bf16", "argmax_bf16"):
            getattr(lib, f"vlm_{name}").restype = None
        self._lib = lib
        self.path = library

    def linear_bf16(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] bf16, weight [N, K] bf16, bias [N] bf16 -> [..., N] bf16 (fp32 accumulation)."""
        k = x.shape[-1]
        n = weight.shape[0]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        if m >= GEMM_ROWS:
            # NOTE: the same arithmetic (exact widening, fp32 accumulation, one rounding).
            out = torch.nn.functional.linear(x2.float(), self.widen(weight), None if bias is None else self.widen(bias))
            return out.to(torch.bfloat16).reshape(*x.shape[:-1], n)
        x2 = x2.contiguous()
        assert weight.is_contiguous() and (bias is None or bias.is_contiguous())
        y = torch.empty(m, n, dtype=torch.bfloat16)
        self._lib.vlm_linear_bf16(
            x2.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k
        )
        return y.reshape(*x.shape[:-1], n)

    def decode_attention(
        self,
        q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
        seq_lens: torch.Tensor,  # [num_seqs] int64
        scale: float,
    ) -> torch.Tensor | None:
        """One query token per sequence over its paged KV; None where the kernel does not apply."""
        if not decode_kernel_applies(q, kv_cache):
            return None
        return _decode_attention(
            self._lib.vlm_decode_attention, q, kv_cache, block_tables, seq_lens, scale, int(q.dtype == torch.bfloat16)
        )

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, RMSNorm of it) for bf16 [num_tokens, hidden] x and delta (contiguous) and
        bf16 weight; without delta, (x, RMSNorm of x)."""
        m, h = x.shape
        out = torch.empty_like(x)
        total = x if delta is None else torch.empty_like(x)
        self._lib.vlm_add_rms_norm_bf16(
            x.data_ptr(), 0 if delta is None else delta.data_ptr(), weight.data_ptr(), total.data_ptr(),
            out.data_ptr(), m, h, eps,
        )  # fmt: skip
        return total, out

    def rms_norm_heads_(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """RMSNorm of each head in place: x [n, heads, D] bf16 with contiguous heads (rows may be
        strided: a view of a fused qkv output), weight [D] bf16 (add_rms_norm's arithmetic)."""
        n, heads, d = x.shape
        assert x.stride(2) == 1 and x.stride(1) == d and weight.is_contiguous()
        self._lib.vlm_rms_norm_heads_bf16(x.data_ptr(), x.stride(0), weight.data_ptr(), n, heads, d, eps)

    def rotary_qk_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate-half rotary embedding in place: q [n, nq, D], k [n, nk, D] bf16 with contiguous
        heads (rows may be strided: views of a fused qkv output); cos, sin [n, D] contiguous, bf16
        (each op rounds to bf16, as torch's bf16 ops) or fp32 (fp32 arithmetic, one rounding)."""
        _rotary_qk_(self._lib.vlm_rotary_qk_bf16, q, k, cos, sin)

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """Per row of bf16 [rows, vocab] logits, torch.argmax of their fp32 values (the first
        largest; a NaN counts as the largest), without widening them."""
        logits = logits.contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._lib.vlm_argmax_bf16(logits.data_ptr(), out.data_ptr(), logits.shape[0], logits.shape[1])
        return out.tolist()

    def topk(
        self,
        x: torch.Tensor,
        rows: list[int],
        k: int,
        bitmask: torch.Tensor | None = None,
        mask_rows: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The k largest values of rows `rows` of bf16 or fp32 x [R, n] (each row contiguous, k <=
        n), as torch.topk's sorted=True orders them (NaN above +inf; among equal values the
        earlier index first): values [len(rows), k] fp32, indices [len(rows), k] int64. bitmask
        [B, ceil(n / 32)] int32 (structured outputs' masks, xgrammar's layout): output i takes
        only the tokens row mask_rows[i] of it allows (-1: all); past them, -inf values."""
        assert x.dtype in (torch.bfloat16, torch.float32) and x.dim() == 2 and x.stride(1) == 1
        assert 0 < k <= x.shape[1]
        index = torch.tensor(rows, dtype=torch.int64)
        values = torch.empty(len(rows), k, dtype=torch.float32)
        indices = torch.empty(len(rows), k, dtype=torch.int64)
        if bitmask is not None:
            assert mask_rows is not None and len(mask_rows) == len(rows)
            assert bitmask.dtype == torch.int32 and bitmask.stride(1) == 1 and bitmask.shape[1] * 32 >= x.shape[1]
            masks = torch.tensor(mask_rows, dtype=torch.int64)
        self._lib.vlm_topk(
            x.data_ptr(), x.stride(0), int(x.dtype == torch.bfloat16), index.data_ptr(), len(rows), x.shape[1], k,
            values.data_ptr(), indices.data_ptr(),
            0 if bitmask is None else bitmask.data_ptr(), 0 if bitmask is None else bitmask.stride(0),
            0 if bitmask is None else masks.data_ptr(),
        )  # fmt: skip
        return values, indices

    def apply_bitmask(self, x: torch.Tensor, rows: list[int], bitmask: torch.Tensor, mask_rows: list[int]) -> None:
        """In place: in row rows[i] of fp32 x [R, n] (each row contiguous), the tokens bitmask row
        mask_rows[i] forbids (xgrammar's layout: [B, ceil(n / 32)] int32, a set bit allows) get -inf."""
        assert x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1 and len(rows) == len(mask_rows)
        assert bitmask.dtype == torch.int32 and bitmask.stride(1) == 1 and bitmask.shape[1] * 32 >= x.shape[1]
        index, masks = torch.tensor(rows, dtype=torch.int64), torch.tensor(mask_rows, dtype=torch.int64)
        self._lib.vlm_apply_bitmask(
            x.data_ptr(), x.stride(0), index.data_ptr(), len(rows), x.shape[1], bitmask.data_ptr(), bitmask.stride(0),
            masks.data_ptr(),
        )  # fmt: skip

    def widen(self, t: torch.Tensor) -> torch.Tensor:
        """bf16 -> fp32 at memory speed (torch's own conversion runs at ~0.5 G elements/s here)."""
        t = t.contiguous()
        out = torch.empty(t.shape, dtype=torch.float32)
        self._lib.vlm_bf16_to_f32(t.data_ptr(), out.data_ptr(), t.numel())
        return out


@cache
def load_cpu_kernels() -> CpuKernels | None:
    if os.environ.get("VLMSERVE_CPU_KERNELS", "1") == "0" or not _cpu_has_avx2():
        return None
    try:
        library = _build(SOURCE)
        return CpuKernels(library) if library else None
    except OSError as e:
        logger.warning("loading the CPU kernels failed (%s); using torch's kernels", e)
        return None


class Avx512Kernels:
    """cpu_linear_avx512.c: the bf16 linear product with AVX-512 BF16 dot products, any row count,
    attention (paged decode; prefill and the vision tower's segments), and the MLP activations."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))  # loaded after torch: shares its OpenMP pool
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.vlm_linear_bf16_avx512.argtypes = [p, p, p, p, i64, i64, i64]
        lib.vlm_linear_bf16_avx512.restype = None
        lib.vlm_decode_attention_avx512.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float]
        lib.vlm_decode_attention_avx512.restype = None
        lib.vlm_prefill_attention_avx512.argtypes = [p, p, p, p, *[i64] * 9, ctypes.c_float, i64]
        lib.vlm_prefill_attention_avx512.restype = ctypes.c_int
        lib.vlm_activation_bf16_avx512.argtypes = [p, p, i64, i64, i64, i64]
        lib.vlm_activation_bf16_avx512.restype = None
        lib.vlm_rotary_qk_avx512.argtypes = [p, p, i64, i64, p, p, i64, i64, i64, i64, i64]
        lib.vlm_rotary_qk_avx512.restype = None
        lib.vlm_linear_packed_avx512.argtypes = [p, p, p, p, i64, i64, i64]
        lib.vlm_linear_packed_avx512.restype = ctypes.c_int
        f32 = ctypes.c_float
        lib.vlm_decode_step_avx512.argtypes = [p, p, p, i64, p, p, p, p, p, p, *[i64] * 9, f32, f32]
        lib.vlm_decode_step_avx512.restype = ctypes.c_int
        self._lib = lib
        self.path = library

    def linear_bf16(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] bf16, weight [N, K] bf16, bias [N] bf16 -> [..., N] bf16 (fp32 sums, one rounding)."""
        k = x.shape[-1]
        n = weight.shape[0]
        x2 = x.reshape(-1, k).contiguous()
        assert weight.is_contiguous() and (bias is None or bias.is_contiguous())
        y = torch.empty(x2.shape[0], n, dtype=torch.bfloat16)
        self._lib.vlm_linear_bf16_avx512(
            x2.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), x2.shape[0], n, k
        )
        return y.reshape(*x.shape[:-1], n)

    def linear_packed(
        self, x: torch.Tensor, weight: torch.Tensor, weight_address: int, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """x [..., K] bf16 times a weight [N, K] in oneDNN's reordered layout (kernels/onednn.py),
        read at weight_address (N a multiple of 64, K even), bias [N] bf16 -> [..., N] bf16 (fp32
        sums, one rounding); None where the kernel declines (shape, alignment, memory)."""
        k = x.shape[-1]
        n = weight.shape[0]
        x2 = x.reshape(-1, k).contiguous()
        assert bias is None or bias.is_contiguous()
        y = torch.empty(x2.shape[0], n, dtype=torch.bfloat16)
        failed = self._lib.vlm_linear_packed_avx512(
            x2.data_ptr(), weight_address, 0 if bias is None else bias.data_ptr(), y.data_ptr(), x2.shape[0], n, k
        )
        return None if failed else y.reshape(*x.shape[:-1], n)

    def decode_step(
        self,
        x: torch.Tensor,  # [M, H] bf16: the embeddings; overwritten by the residual stream
        layers: torch.Tensor,  # [num_layers, 21] int64: the addresses vlm_decode_step_avx512 lists
        final_norm: torch.Tensor,  # [H] bf16
        cos: torch.Tensor,  # [M, head_dim] bf16
        sin: torch.Tensor,
        slots: torch.Tensor,  # [M] int64
        block_tables: torch.Tensor,  # [M, max_blocks] int64
        seq_lens: torch.Tensor,  # [M] int64
        kv_shape: tuple[int, ...],  # every layer's cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
        num_heads: int,
        intermediate_size: int,
        eps: float,
        scale: float,
    ) -> torch.Tensor | None:
        """A whole Qwen2 or Qwen3 decoder's decode step in one call (vlm_decode_step_avx512): the final norm's
        output [M, H] bf16, or None where the kernel declines (shapes, alignment, memory) before
        writing anything. The tensors contiguous, int64 where said."""
        m, h = x.shape
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_shape
        out = torch.empty_like(x)
        failed = self._lib.vlm_decode_step_avx512(
            x.data_ptr(), out.data_ptr(), layers.data_ptr(), layers.shape[0], final_norm.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), slots.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(), m, h, intermediate_size,
            num_heads, num_kv_heads, head_dim, num_blocks, block_size, block_tables.shape[1], eps, scale,
        )  # fmt: skip
        return None if failed else out

    def decode_attention(
        self,
        q: torch.Tensor,  # [num_seqs, num_heads, head_dim] bf16
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] bf16
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
        seq_lens: torch.Tensor,  # [num_seqs] int64
        scale: float,
    ) -> torch.Tensor | None:
        """CpuKernels.decode_attention with bf16 dot products (cpu_linear_avx512.c), for bf16 and a
        head_dim that is a multiple of 32; None where it does not apply. 32 sequences x 450 tokens
        (random block tables), 12 heads, 2 KV heads, head_dim 128, 2 threads on the Zen 4 machine:
        1.30 ms against the AVX2 kernel's 1.85 (outputs equal but for 0.02 % one bf16 step apart)."""
        if q.dtype != torch.bfloat16 or q.shape[-1] % 32 or not decode_kernel_applies(q, kv_cache):
            return None
        return _decode_attention(self._lib.vlm_decode_attention_avx512, q, kv_cache, block_tables, seq_lens, scale)

    def prefill_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int | None
    ) -> torch.Tensor | None:
        """Attention of q [q_len, heads, dim] over k, v [kv_len, kv_heads, dim] (bf16; query head h
        reads KV head h // (heads / kv_heads)): all keys with causal_offset None (the vision
        tower), else query i sees keys 0 .. causal_offset + i. [q_len, heads, dim] bf16, or None
        where the kernel does not apply (prefill_kernel_applies). The arithmetic of torch's CPU
        flash kernel, both products by vdpbf16ps; Qwen2-VL-2B's vision attention (1024 patches, 16
        heads of 80) on the Zen 4 machine, 2 threads: 17.0-17.4 ms against SDPA's 33.5 (docs/benchmarks.md)."""
        if not prefill_kernel_applies(q, k, v):
            return None
        q_len, num_heads, dim = q.shape
        out = torch.empty(q_len, num_heads, dim, dtype=torch.bfloat16)
        failed = self._lib.vlm_prefill_attention_avx512(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), q_len, k.shape[0], num_heads, k.shape[1], dim,
            q.stride(0), k.stride(0), v.stride(0), out.stride(0), scale, -1 if causal_offset is None else causal_offset,
        )  # fmt: skip
        return None if failed else out  # failed: no memory for the packed K and V

    def rotary_qk_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """CpuKernels.rotary_qk_ 16 lanes at a time, the same results bit for bit."""
        _rotary_qk_(self._lib.vlm_rotary_qk_avx512, q, k, cos, sin)

    def quick_gelu(self, x: torch.Tensor) -> torch.Tensor:
        """x * sigmoid(1.702 x) of bf16 [..., n] with contiguous rows, rounded as torch's bf16 ops."""
        return self._activation(x, x.shape[-1], 0)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of bf16 [..., 2n] rows [gate | up] -> [..., n], rounded as torch's bf16 ops."""
        return self._activation(x, x.shape[-1] // 2, 1)

    def _activation(self, x: torch.Tensor, n: int, kind: int) -> torch.Tensor:
        assert x.dtype == torch.bfloat16 and x.stride(-1) == 1
        x2 = x.reshape(-1, x.shape[-1])  # a view where the rows allow
        out = torch.empty(x2.shape[0], n, dtype=torch.bfloat16)
        self._lib.vlm_activation_bf16_avx512(x2.data_ptr(), out.data_ptr(), x2.shape[0], n, x2.stride(0), kind)
        return out.reshape(*x.shape[:-1], n)


@cache
def load_avx512_kernels() -> Avx512Kernels | None:
    if os.environ.get("VLMSERVE_CPU_KERNELS", "1") == "0" or not _cpu_has_avx512_bf16():
        return None
    try:
        library = _build(AVX512_SOURCE, AVX512_FLAGS)
        return Avx512Kernels(library) if library else None
    except OSError as e:
        logger.warning("loading the AVX-512 CPU kernel failed (%s); using another path", e)
        return None
