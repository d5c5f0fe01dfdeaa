"""4-bit weights kept packed (AWQ and GPTQ checkpoints): y = x @ W.T (+ bias), W dequantized from
4-bit fields with a scale and a zero point per output and group of inputs (the blocked layout of
cpu_int4.c, written by models/quant/int4.py), x and y in the model's dtype.

Where the CPU has AVX-512 BF16 and the activations are bf16, cpu_int4_avx512.c reads the 4-bit
weights itself at every row count: a decode step reads a quarter of bf16's weight bytes, and at
prefill's hundreds of rows its 8-row tiles keep vdpbf16ps about as busy as oneDNN's bf16 GEMM
(measured on the 2-core Zen 4 machine, 341 rows of Qwen2-VL-2B: [17920, 1536] 45.6 ms against
46.5 for bf16 F.linear and 75.5 for dequantizing to bf16 and then F.linear; [1536, 8960] 23.9
against 22.2 and 35.7). Elsewhere up to KERNEL_MAX_ROWS rows go to cpu_int4.c (AVX2, fp32
activations; bf16 ones are widened), and more rows dequantize DEQUANT_ROWS outputs at a time into
the activations' dtype (cpu_int4.c's vlm_dequant_int4, exact: the weights a float checkpoint of
the dequantized matrix would hold) for the model's float product. VLMSERVE_CPU_PATH (kernels/dispatch.py)
forces a path here too: avx2 -> cpu_int4.c, avx512 -> cpu_int4_avx512.c, torch -> dequantize per
call at every size.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from vlmserve.kernels.op import LinearOp

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_int4.c")
AVX512_SOURCE = Path(__file__).with_name("cpu_int4_avx512.c")
KERNEL_MAX_ROWS = 64
DEQUANT_ROWS = 4096  # a multiple of the layout's 16-output blocks
BLOCK = 16  # outputs per block of the layout
# The kernels' loops take groups of whole 16-input runs.
GROUP_MULTIPLE = 16


class Int4Kernel:
    """cpu_int4.c (AVX2) and, where it builds, cpu_int4_avx512.c."""

    avx512_address: int | None = None  # vlm_linear_int4_avx512, for the fused decode step's table
    decode = True  # False where VLMSERVE_CPU_PATH=torch: every call dequantizes

    def __init__(self, library: Path, avx512: Path | None) -> None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib = ctypes.CDLL(str(library))  # loaded after torch: shares its OpenMP pool
        lib.vlm_linear_int4.argtypes = [p, p, p, p, i64, i64, i64]
        lib.vlm_linear_int4.restype = None
        lib.vlm_dequant_int4.argtypes = [p, p, i64, i64, i64, i64]
        lib.vlm_dequant_int4.restype = None
        self._lib = lib
        self._avx512 = None
        if avx512 is not None:
            fast = ctypes.CDLL(str(avx512))
            fast.vlm_linear_int4_avx512.argtypes = [p, p, p, p, p, i64, i64, i64, i64]
            fast.vlm_linear_int4_avx512.restype = None
            self._avx512 = fast
            self.avx512_address = ctypes.cast(fast.vlm_linear_int4_avx512, ctypes.c_void_p).value

    @property
    def has_avx512(self) -> bool:
        return self._avx512 is not None

    def linear(
        self, x: torch.Tensor, desc: torch.Tensor, bias: torch.Tensor | None, n: int, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """x [M, K] (bf16 for the AVX-512 kernel, else fp32), desc int64 [3] (models/quant/int4.py),
        bias fp32 [N] -> [M, N] in out_dtype (the AVX-512 kernel rounds into bf16 itself)."""
        m, k = x.shape
        x = x.contiguous()
        b = 0 if bias is None else bias.data_ptr()
        if self._avx512 is not None and x.dtype == torch.bfloat16:
            assert out_dtype in (torch.bfloat16, torch.float32)
            y = torch.empty(m, n, dtype=out_dtype)
            self._avx512.vlm_linear_int4_avx512(
                x.data_ptr(), desc.data_ptr(), None, b, y.data_ptr(), m, n, k, int(out_dtype == torch.bfloat16)
            )
            return y
        assert x.dtype == torch.float32
        y = torch.empty(m, n, dtype=torch.float32)
        self._lib.vlm_linear_int4(x.data_ptr(), desc.data_ptr(), b, y.data_ptr(), m, n, k)
        return y if out_dtype == torch.float32 else y.to(out_dtype)

    def dequantize(self, desc: torch.Tensor, n0: int, n1: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        """Outputs n0 .. n1 of the weight (n0 a multiple of 16) -> [n1 - n0, K] fp32 or bf16."""
        assert n0 % BLOCK == 0 and dtype in (torch.float32, torch.bfloat16)
        out = torch.empty(n1 - n0, k, dtype=dtype)
        self._lib.vlm_dequant_int4(desc.data_ptr(), out.data_ptr(), n0, n1, k, int(dtype == torch.bfloat16))
        return out

    def describe(self) -> str:
        if not self.decode:
            return "dequantize per call (VLMSERVE_CPU_PATH=torch)"
        avx2 = f"cpu_int4.c (AVX2) up to {KERNEL_MAX_ROWS} rows, more rows dequantize"
        if self._avx512 is None:
            return f"vlmserve CPU int4 kernel: {avx2}"
        avx512 = "cpu_int4_avx512.c (AVX-512 BF16) for bf16 activations at every row count"
        return f"vlmserve CPU int4 kernel: {avx512}; else {avx2}"


@cache
def load_int4_kernel() -> Int4Kernel | None:
    """The int4 kernels for the path VLMSERVE_CPU_PATH asks for (auto: the AVX-512 one where it
    builds, else AVX2); None where cpu_int4.c does not build here (no AVX2, no compiler,
    VLMSERVE_CPU_KERNELS=0): the checkpoint is then dequantized when it loads."""
    from vlmserve.kernels.dispatch import build_quantized_pair

    try:
        built = build_quantized_pair(SOURCE, AVX512_SOURCE, "int4")
        if built is None:
            return None
        library, avx512, decode = built
        kernel = Int4Kernel(library, avx512)
        kernel.decode = decode
        return kernel
    except OSError as e:
        logger.warning("loading the int4 CPU kernels failed (%s); dequantizing the checkpoint when it loads", e)
        return None


def int4_linear(
    x: torch.Tensor,
    desc: torch.Tensor,
    bias: torch.Tensor | None,
    n: int,
    kernel: Int4Kernel,
    dense: LinearOp = F.linear,
) -> torch.Tensor:
    """x [..., K] in the model dtype -> [..., N] in the same dtype. desc: the layer's (see
    cpu_int4.c); bias [N] in x's dtype; dense: the float product the model's other layers use."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if kernel.decode and kernel.has_avx512 and x2.dtype == torch.bfloat16:
        # every row count: at prefill's hundreds of rows the kernel keeps vdpbf16ps as busy as
        # oneDNN's bf16 GEMM does, with no dequantized copy (see the module's docstring)
        return kernel.linear(x2, desc, None if bias is None else bias.float(), n, x.dtype).reshape(*x.shape[:-1], n)
    if kernel.decode and x2.shape[0] <= KERNEL_MAX_ROWS:
        b = None if bias is None else bias.float()
        return kernel.linear(x2.float(), desc, b, n, x.dtype).reshape(*x.shape[:-1], n)
    dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
    if n <= DEQUANT_ROWS:
        w = kernel.dequantize(desc, 0, n, k, dtype)
        return dense(x2.to(dtype), w, None if bias is None else bias.to(dtype)).to(x.dtype).reshape(*x.shape[:-1], n)
    # NOTE: DEQUANT_ROWS outputs at a time, so that a large layer never holds a float copy whole.
    out = torch.empty(x2.shape[0], n, dtype=x.dtype)
    for start in range(0, n, DEQUANT_ROWS):
        end = min(n, start + DEQUANT_ROWS)
        w = kernel.dequantize(desc, start, end, k, dtype)
        out[:, start:end] = dense(x2.to(dtype), w, None if bias is None else bias[start:end].to(dtype))
    return out.reshape(*x.shape[:-1], n)
