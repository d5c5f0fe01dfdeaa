"""Loads the CPU bf16 linear kernel (cpu_linear.c): compiled with the system C compiler on first
use, cached by source hash, called through ctypes (which releases the GIL).

Nothing here runs at import time. `load_cpu_kernels()` returns None, and callers keep torch's
own path, when the CPU lacks AVX2/FMA/F16C, no compiler is found, the build fails, or
VLMSERVE_CPU_KERNELS=0.
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

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_linear.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
# At or above this many rows a linear layer is compute-bound: widen the weights once and use
# torch's fp32 GEMM (MKL), which blocks for the caches far better than a simple kernel.
GEMM_ROWS = 96


def _cpu_has_avx2(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    try:
        flags = cpuinfo.read_text()
    except OSError:
        return False
    return all(f" {flag}" in flags for flag in ("avx2", "fma", "f16c"))


def _cache_dir() -> Path:
    return Path(os.environ.get("VLMSERVE_CACHE", Path.home() / ".cache" / "vlmserve")) / "kernels"


def _build(source: Path) -> Path | None:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    digest = hashlib.sha256(source.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *FLAGS, str(source), "-o", str(built)], capture_output=True, text=True)
        if result.returncode != 0:
            logger.warning("building the CPU kernels failed; using torch's kernels:\n%s", result.stderr[-2000:])
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
        num_seqs, num_heads, head_dim = q.shape
        _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
        q = q.contiguous()
        block_tables = block_tables.to(torch.int64).contiguous()
        seq_lens = seq_lens.to(torch.int64).contiguous()
        out = torch.empty_like(q)
        self._lib.vlm_decode_attention(
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
            int(q.dtype == torch.bfloat16),
        )
        return out

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
