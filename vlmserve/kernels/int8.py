"""Weight-only int8 matrix products: y = (x @ q.T) * scale (+ bias), q int8 [N, K] with one scale
per output channel, x and y in the model's dtype.

Chosen by measurement (`python -m vlmserve.bench.quant --ops`: N=8960 K=1536, bf16 activations,
19 copies of the matrix so it streams from memory) on an AMD EPYC Zen 4 (AVX-512 BF16), 2 cores
shared with ~8 busy processes (load average 6-10: absolute times are several times a quiet
machine's and vary +-50% between runs; three runs, ms per matrix):
- M=1: bf16 F.linear 24-29, torch._weight_int8pack_mm 20-27, cpu_int8.c 21-25. The two int8
  products are a wash in speed; cpu_int8.c is kept because it applies fp32 scales (torch's
  kernel takes the scales in the activations' dtype, rounding each to 8 bits with bf16) and
  because it is the same AVX2 code on the AVX2-only machines this project also runs on.
- M=32 / 64: cpu_int8.c 51-74 / 54-113, torch._weight_int8pack_mm 60-88 / 64-106, dequantize
  to bf16 then torch's product 130-220 / 130-300 (bf16 F.linear: 23-34 / 28-48, oneDNN with
  AVX-512 BF16 on this CPU; without it torch's bf16 product is several times slower).
- M=256: dequantize + product 98-281, cpu_int8.c 137-358, bf16 F.linear 78-138.
- Dequantizing per call with torch's own conversions takes ~40 ms for this matrix: never used.
So: up to KERNEL_MAX_ROWS rows (decode, batched decode) -> cpu_int8.c where it builds; more rows
(prefill, compute-bound) -> dequantize into the activation dtype (cpu_int8.c's converter) and
the model's float product (the layer's bound `op`). Without the C kernel (no AVX2, no compiler,
VLMSERVE_CPU_KERNELS=0) every size takes the dequantize path: correct, slower for decode.
NOTE: on this AVX-512 BF16 machine a batch of 32+ decoding sequences ran faster in bf16 than in
int8 with cpu_int8.c (torch's bf16 product is bound by bandwidth there, the int8 widening by
compute on AVX2). So where the CPU has AVX-512 BF16 and the activations are bf16, the decode path
is cpu_int8_avx512.c (int8 widened to bf16 once per weight tile, 32-wide bf16 dot products; its
own .so, built with its own -m flags), up to KERNEL_MAX_ROWS_AVX512 rows. VLMSERVE_CPU_PATH
(kernels/dispatch.py) forces a path here too: avx2 -> cpu_int8.c, avx512 -> cpu_int8_avx512.c,
torch -> dequantize per call at every size.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from vlmserve.kernels.op import LinearOp

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_int8.c")
AVX512_SOURCE = Path(__file__).with_name("cpu_int8_avx512.c")
# Up to this many rows the weights' bytes bound the product (decode of a batch); above, compute
# does and torch's GEMM on dequantized weights is faster.
KERNEL_MAX_ROWS = 64
# The AVX-512 BF16 kernel's limit: a verify step of 8 sequences x 9 rows is 72, and the kernel was
# still ahead of dequantizing for torch's product there (Zen 4, 2 threads, best of 5: [17920, 1536]
# 14.8 against 48.1 ms at 72 rows, 20.7 against 50.6 at 96).
KERNEL_MAX_ROWS_AVX512 = 96
# Output channels dequantized at once on the GEMM path.
DEQUANT_ROWS = 4096


def _int8_product(
    fn: Any,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Call one of the C int8 products (same leading arguments in both kernels): [M, K] x [N, K] ->
    [M, N] fp32, or out_dtype (passed on as the AVX-512 kernel's last argument, bf16 or not)."""
    m, k = x.shape
    n = qweight.shape[0]
    x = x.contiguous()
    y = torch.empty(m, n, dtype=out_dtype or torch.float32)
    bias_ptr = 0 if bias is None else bias.data_ptr()
    flag = () if out_dtype is None else (int(out_dtype == torch.bfloat16),)
    fn(x.data_ptr(), qweight.data_ptr(), scales.data_ptr(), bias_ptr, y.data_ptr(), m, n, k, *flag)
    return y


class Int8Avx512Kernel:
    """cpu_int8_avx512.c: the decode product for bf16 activations."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))  # loaded after torch: shares its OpenMP pool
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.vlm_linear_int8_avx512.argtypes = [p, p, p, p, p, i64, i64, i64, i64]
        lib.vlm_linear_int8_avx512.restype = None
        self._lib = lib
        # for a C caller: the fused decode step (cpu_linear_avx512.c's vlm_decode_step_avx512)
        self.product_address = ctypes.cast(lib.vlm_linear_int8_avx512, ctypes.c_void_p).value
        self.path = library

    def linear(
        self,
        x: torch.Tensor,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """x [M, K] bf16, qweight [N, K] int8, scales [N] fp32, bias [N] fp32 -> [M, N] fp32, or
        bf16 (the fp32 result rounded once, as .to(torch.bfloat16) rounds it)."""
        k = x.shape[1]
        n = qweight.shape[0]
        assert x.dtype == torch.bfloat16 and qweight.shape == (n, k) and qweight.dtype == torch.int8
        assert qweight.is_contiguous() and scales.dtype == torch.float32 and scales.shape == (n,)
        assert out_dtype in (torch.float32, torch.bfloat16)
        return _int8_product(self._lib.vlm_linear_int8_avx512, x, qweight, scales, bias, out_dtype)


class Int8Kernel:
    # The AVX-512 BF16 decode kernel, where this machine has it and the path allows it (bf16
    # activations only; fp32 ones keep this AVX2 kernel, exact for them).
    avx512: Int8Avx512Kernel | None = None
    # False where VLMSERVE_CPU_PATH=torch: decode dequantizes per call too (this object then only
    # does the dequantizing).
    decode = True

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))  # loaded after torch: shares its OpenMP pool
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.vlm_linear_int8.argtypes = [p, p, p, p, p, i64, i64, i64]
        lib.vlm_linear_int8.restype = None
        lib.vlm_dequant_int8.argtypes = [p, p, p, i64, i64, i64]
        lib.vlm_dequant_int8.restype = None
        self._lib = lib
        self.path = library

    def linear(
        self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [M, K] fp32, qweight [N, K] int8, scales [N] fp32, bias [N] fp32 -> [M, N] fp32."""
        k = x.shape[1]
        n = qweight.shape[0]
        assert qweight.shape == (n, k) and qweight.dtype == torch.int8 and qweight.is_contiguous()
        assert scales.dtype == torch.float32 and scales.shape == (n,)
        return _int8_product(self._lib.vlm_linear_int8, x, qweight, scales, bias)

    def describe(self) -> str:
        if not self.decode:
            return "dequantize per call (VLMSERVE_CPU_PATH=torch)"
        if self.avx512:
            return (
                f"vlmserve CPU int8 kernel: cpu_int8_avx512.c (AVX-512 BF16) for bf16 activations up to "
                f"{KERNEL_MAX_ROWS_AVX512} rows, else cpu_int8.c (AVX2) up to {KERNEL_MAX_ROWS}"
            )
        return f"vlmserve CPU int8 kernel up to {KERNEL_MAX_ROWS} rows: cpu_int8.c (AVX2)"

    def dequantize(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] int8, [N] fp32 -> [N, K] fp32 or bf16 (rounded to nearest even once)."""
        assert qweight.is_contiguous() and scales.dtype == torch.float32 and scales.is_contiguous()
        n, k = qweight.shape
        out = torch.empty(n, k, dtype=dtype)
        self._lib.vlm_dequant_int8(
            qweight.data_ptr(), scales.data_ptr(), out.data_ptr(), n, k, int(dtype == torch.bfloat16)
        )
        return out


@cache
def load_int8_kernel() -> Int8Kernel | None:
    """The int8 kernels for the path VLMSERVE_CPU_PATH asks for (kernels/dispatch.py; auto: the
    AVX-512 one where it builds, else AVX2); None for "torch" or where none builds."""
    from vlmserve.kernels.dispatch import build_quantized_pair

    try:
        built = build_quantized_pair(SOURCE, AVX512_SOURCE, "int8")
        if built is None:
            return None
        library, avx512, decode = built
        kernel = Int8Kernel(library)
        kernel.decode = decode
        kernel.avx512 = Int8Avx512Kernel(avx512) if avx512 else None
        return kernel
    except OSError as e:
        logger.warning("loading the int8 CPU kernel failed (%s); dequantizing per call instead", e)
        return None


def dequantize_int8(
    qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, kernel: Int8Kernel | None = None
) -> torch.Tensor:
    """[N, K] int8 and [N] fp32 scales -> [N, K] in dtype (the product rounded once, from fp32)."""
    if kernel is not None and qweight.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        return kernel.dequantize(qweight, scales, dtype)
    return (qweight.float() * scales.float()[:, None]).to(dtype)


def int8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    kernel: Int8Kernel | None,
    dense: LinearOp = F.linear,
) -> torch.Tensor:
    """x [..., K] in the model dtype -> [..., N] in the same dtype. scales fp32 [N]; bias [N] in
    x's dtype. dense: the float product the model's other layers use (for the many-row path)."""
    k = x.shape[-1]
    n = qweight.shape[0]
    x2 = x.reshape(-1, k)
    fast = kernel is not None and kernel.avx512 is not None and x2.dtype == torch.bfloat16
    max_rows = KERNEL_MAX_ROWS_AVX512 if fast else KERNEL_MAX_ROWS
    if kernel is not None and kernel.decode and x.device.type == "cpu" and x2.shape[0] <= max_rows:
        b = None if bias is None else bias.float()
        if kernel.avx512 is not None and x2.dtype == torch.bfloat16:
            out = kernel.avx512.linear(x2, qweight, scales, b, out_dtype=torch.bfloat16)
        else:
            out = kernel.linear(x2.float(), qweight, scales, b).to(x.dtype)
        return out.reshape(*x.shape[:-1], n)
    # NOTE: dequantized DEQUANT_ROWS output channels at a time, so a vocabulary-sized lm_head
    # never holds a full-precision copy (151936 x 1536 in bf16 would be 0.47 GB).
    if n <= DEQUANT_ROWS:
        out = dense(x2, dequantize_int8(qweight, scales, x.dtype, kernel), bias)
    else:
        out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
        for start in range(0, n, DEQUANT_ROWS):
            end = min(n, start + DEQUANT_ROWS)
            w = dequantize_int8(qweight[start:end], scales[start:end], x.dtype, kernel)
            out[:, start:end] = dense(x2, w, None if bias is None else bias[start:end])
    return out.reshape(*x.shape[:-1], n)
