"""The few-row product on weights reordered for oneDNN (vlm_linear_packed_avx512, kernels/onednn.py's
packed_linear): oneDNN's layout as the kernel reads it, element by element, and the product
against an fp64 reference, with and without bias, at every pass size of the kernel; past
PACKED_ROWS the product is oneDNN's. Skipped where oneDNN's bf16 reorder or AVX-512 BF16 is absent."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from vlmserve.kernels import cpu
from vlmserve.kernels.onednn import (
    PACKED_ROWS,
    packed_layout,
    packed_linear,
    prepack_available,
    prepacked_linear,
    reorder_weight,
    weight_address,
    weight_nbytes,
)

avx512 = cpu.load_avx512_kernels()
pytestmark = pytest.mark.skipif(
    avx512 is None or not prepack_available(), reason="no AVX-512 BF16 kernels or no oneDNN bf16 reorder here"
)


def _memory(packed: torch.Tensor) -> torch.Tensor:
    """The reordered weight's memory, as int16."""
    out = torch.empty(weight_nbytes(packed) // 2, dtype=torch.int16)
    ctypes.memmove(out.data_ptr(), weight_address(packed), weight_nbytes(packed))
    return out


@pytest.mark.parametrize(("n", "k"), [(64, 32), (128, 64), (192, 1056)])
def test_reordered_layout_holds_each_element_where_the_kernel_reads_it(n: int, k: int) -> None:
    assert packed_layout(n, k)
    # element (i, j) holds a value that names it: i * k + j (small integers are exact in bf16
    # up to 256; two tensors carry the row and the column)
    rows = torch.arange(n)[:, None].expand(n, k)
    cols = torch.arange(k)[None, :].expand(n, k)
    for values, name in ((rows, "row"), (cols, "column")):
        for part in (values % 256, values // 256):
            memory = _memory(reorder_weight(part.to(torch.bfloat16).contiguous()))
            got = memory.view(torch.bfloat16).float().long()
            i, j = rows.flatten(), cols.flatten()
            offset = (i // 64) * 64 * k + (j // 2) * 128 + (i % 64) * 2 + j % 2
            assert torch.equal(got[offset], part.flatten()), f"the {name} index at its offset"


def test_other_shapes_are_not_taken() -> None:
    assert not packed_layout(96, 64)  # not a whole number of 64-row blocks
    assert not packed_layout(128, 63)  # odd k: no pairs
    # oneDNN pads k to a multiple of 32 (zeros between the blocks): another layout
    assert not packed_layout(64, 2) and not packed_layout(192, 200)
    assert avx512 is not None
    w = torch.randn(96, 64).bfloat16()
    assert avx512.linear_packed(torch.randn(1, 64).bfloat16(), w, w.data_ptr(), None) is None


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 32])  # one pass of up to 6 rows, several, a tail
@pytest.mark.parametrize(("n", "k", "bias"), [(128, 64, False), (192, 1056, True)])  # 1056: chunks of 512 pairs
def test_product_matches_fp64_reference(rows: int, n: int, k: int, bias: bool) -> None:
    assert avx512 is not None and packed_layout(n, k)
    g = torch.Generator().manual_seed(rows * n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, k, generator=g).bfloat16()
    packed = reorder_weight(w)
    y = avx512.linear_packed(x, packed, weight_address(packed), b)
    assert y is not None and y.shape == (rows, n) and y.dtype == torch.bfloat16
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    # exact products, fp32 sums (~k * 2^-24 of the sum of |products|), one rounding (2^-8 of |y|)
    size = (x.double().abs() @ w.double().abs().T) + (0 if b is None else b.double().abs())
    assert ((y.double() - ref).abs() <= 2.0**-8 * ref.abs() + k * 2.0**-23 * size).all()
    # packed_linear: the same product for a 3-D input (a view), and oneDNN's past PACKED_ROWS
    assert torch.equal(packed_linear(x[None], packed, b)[0], y)


def test_more_rows_than_packed_rows_run_onednn() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 64, generator=g).bfloat16()
    packed = reorder_weight(w)
    x = torch.randn(PACKED_ROWS + 1, 64, generator=g).bfloat16()
    assert torch.equal(packed_linear(x, packed, None), prepacked_linear(x, packed, None))
    assert torch.equal(packed_linear(x, packed, None), F.linear(x, w))
